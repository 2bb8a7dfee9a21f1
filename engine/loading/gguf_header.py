"""What a GGUF file's header may cost before gguf's reader is let loose on it.

`gguf.GGUFReader` builds Python objects for every key, every tensor and every item of every array in the
header, trusting the counts it finds: a 3 MB file that claims a 3-million-item array costs gigabytes and a
minute, and `model list` reads every file in every model store. `read_gguf` first walks the header itself,
skipping over values without building them, and refuses counts no model has or that the file cannot hold,
so that the reader's work stays in proportion to a real model's header.
"""

from __future__ import annotations

import mmap
import os
import struct
from functools import lru_cache
from pathlib import Path

import gguf

from ..errors import ModelError

# The largest tokenizer arrays in use hold 262,144 items (Gemma 3's vocabulary; Llama 3's merges, 280,147):
# twice that for one array, and four times that for the whole header (keys, tensors and items together).
MAX_ARRAY_ITEMS = 1 << 19
MAX_HEADER_ITEMS = 1 << 21
MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NESTING = 2  # an array of arrays at most
_SCALAR_BYTES = {gguf.GGUFValueType.UINT8: 1, gguf.GGUFValueType.INT8: 1, gguf.GGUFValueType.BOOL: 1,
                 gguf.GGUFValueType.UINT16: 2, gguf.GGUFValueType.INT16: 2,
                 gguf.GGUFValueType.UINT32: 4, gguf.GGUFValueType.INT32: 4, gguf.GGUFValueType.FLOAT32: 4,
                 gguf.GGUFValueType.UINT64: 8, gguf.GGUFValueType.INT64: 8, gguf.GGUFValueType.FLOAT64: 8}
_MIN_KV_BYTES = 8 + 4 + 1  # a key's length, the value's type, the smallest value
_MIN_TENSOR_BYTES = 8 + 4 + 4 + 8  # a name's length, the dimension count, the type, the offset


class HeaderRefused(ModelError):
    """A GGUF header that claims more than a model's header holds, or more than its file does: not read."""


def read_gguf(path: Path) -> gguf.GGUFReader:
    """gguf's reader of `path`, once its header is found to cost what a model's may (`check_header`). A load asks
    for it several times (config, tokenizer, sizes, tensors), and building it for a 152k-token vocabulary takes
    seconds: the last few are kept while the file is unchanged."""
    stat = path.stat()
    return _reader(path.resolve(), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=2)
def _reader(path: Path, size: int, mtime_ns: int) -> gguf.GGUFReader:
    check_header(path)
    return gguf.GGUFReader(path)


def forget_readers() -> None:
    """Let the kept readers go (a loaded model's file is not read again while it runs)."""
    _reader.cache_clear()


def check_header(path: Path) -> None:
    """Raise HeaderRefused for a header whose counts or lengths are absurd, naming the first; leave a file that
    is not GGUF, or of a version this walk does not know, to the reader's own errors."""
    with open(path, "rb") as file:
        if os.fstat(file.fileno()).st_size < 8:  # not even a magic and a version: the reader says what is wrong
            return
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[:4] != b"GGUF":
                return
            order = "<" if struct.unpack_from("<I", data, 4)[0] & 0xFFFF else ">"  # as the reader tells byte order
            if struct.unpack_from(f"{order}I", data, 4)[0] not in gguf.READER_SUPPORTED_VERSIONS:
                return
            _Walk(data, order, path.name).header()


class _Walk:
    """A cursor over the header that checks each length against what is left of the file before skipping it."""

    def __init__(self, data: mmap.mmap, order: str, name: str) -> None:
        self.data, self.order, self.name = data, order, name
        self.at = 8  # past the magic and the version
        self.items = 0

    def header(self) -> None:
        tensors, keys = self.number("Q"), self.number("Q")
        self.counted(keys, "keys", _MIN_KV_BYTES)
        self.counted(tensors, "tensors", _MIN_TENSOR_BYTES)
        for _ in range(keys):
            key = self.string()
            self.value(self.number("I"), key, 0)
        for _ in range(tensors):
            tensor = self.string()
            if (dims := self.number("I")) > MAX_DIMS:
                raise self.refused(f"tensor {tensor!r} claims {dims:,} dimensions; a tensor has at most {MAX_DIMS}")
            self.skip(8 * dims + 4 + 8)

    def value(self, kind: int, key: str, depth: int) -> None:
        if kind in _SCALAR_BYTES:
            self.skip(_SCALAR_BYTES[gguf.GGUFValueType(kind)])
        elif kind == gguf.GGUFValueType.STRING:
            self.string()
        elif kind == gguf.GGUFValueType.ARRAY and depth < _MAX_NESTING:
            item, count = self.number("I"), self.number("Q")
            if count > MAX_ARRAY_ITEMS:
                raise self.refused(f"{key!r} claims an array of {count:,} items; a model's header holds at most "
                                   f"{MAX_ARRAY_ITEMS:,} in one")
            self.counted(count, f"items of {key!r}", _SCALAR_BYTES.get(item, 8))
            if item in _SCALAR_BYTES:
                self.skip(count * _SCALAR_BYTES[gguf.GGUFValueType(item)])  # one jump: nothing in it is read
            else:
                for _ in range(count):
                    self.value(item, key, depth + 1)
        else:
            raise self.refused(f"{key!r} has a value of unknown type {kind}")

    def counted(self, count: int, what: str, least_bytes: int) -> None:
        """Count `count` more things in the header, each at least `least_bytes` long, before any is walked."""
        self.items += count
        if self.items > MAX_HEADER_ITEMS:
            raise self.refused(f"it claims {count:,} {what}, over the {MAX_HEADER_ITEMS:,} a model's header holds")
        if count * least_bytes > len(self.data) - self.at:
            raise self.refused(f"it claims {count:,} {what}, more than the rest of the file can hold")

    def number(self, code: str) -> int:
        size = struct.calcsize(code)
        self.skip(size)
        return int(struct.unpack_from(f"{self.order}{code}", self.data, self.at - size)[0])

    def string(self) -> str:
        length = self.number("Q")
        self.skip(length)
        start = self.at - length
        return self.data[start:min(self.at, start + 80)].decode("utf-8", "replace")  # enough to name it by

    def skip(self, size: int) -> None:
        if size > len(self.data) - self.at:
            raise self.refused(f"its header runs past the end of the file (at byte {self.at:,}, {size:,} more "
                               "bytes claimed)")
        self.at += size

    def refused(self, why: str) -> HeaderRefused:
        return HeaderRefused(f"{self.name}: {why}: not read")
