"""Reading safetensors files one tensor at a time into memory the process owns, without mapping the file.

A memory-mapped checkpoint counts in the process's resident memory for every page it has touched (as RssFile),
on top of the copies made from it, so loading through a map holds the weights twice at its peak. Here the file's
header (8 bytes of little-endian length, then JSON: each tensor's dtype, shape and byte offsets after the header,
as safetensors documents it) is parsed once, and each tensor's bytes are read with `os.preadv` straight into the
tensor that keeps them: the file's pages stay in the page cache, which is not the process's.
"""

from __future__ import annotations

import json
import os
import struct
from math import prod
from pathlib import Path

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
_MAX_HEADER = 100 * 2**20
_MAX_READ = 1 << 30  # bytes per read call: Linux reads at most about 2 GiB at once


class TensorFileError(ValueError):
    """A file that is not a safetensors file, or a tensor it does not hold as asked."""


def read_header(path: Path) -> dict[str, dict]:
    """A safetensors file's header: {name: {"dtype", "shape", "data_offsets"}} (and "__metadata__"), read
    without touching its tensors."""
    with path.open("rb") as file:
        return _header(path, file.read(8), file)[0]


def _header(path: Path, prefix: bytes, file) -> tuple[dict[str, dict], int]:
    if len(prefix) != 8:
        raise TensorFileError(f"{path}: not a safetensors file (shorter than its header length)")
    (size,) = struct.unpack("<Q", prefix)
    if size > _MAX_HEADER:
        raise TensorFileError(f"{path}: not a safetensors file (header of {size} bytes)")
    try:
        return json.loads(file.read(size)), 8 + size
    except ValueError as e:
        raise TensorFileError(f"{path}: not a safetensors file ({e})") from e


class TensorFile:
    """One open safetensors file whose tensors are read on request, each into a new tensor of its own."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("rb")
        self.header, self._start = _header(path, self._file.read(8), self._file)
        self.header.pop("__metadata__", None)

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *failure: object) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    def names(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> list[int]:
        return list(self._entry(name)["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return DTYPES[self._entry(name)["dtype"]]

    def read(self, name: str, index: int | None = None) -> torch.Tensor:
        """Tensor `name` (or its `index`-th slice along the first dimension, stored contiguously) in its stored
        dtype, in memory of its own."""
        entry = self._entry(name)
        dtype, shape = DTYPES[entry["dtype"]], list(entry["shape"])
        begin, end = entry["data_offsets"]
        if index is not None:
            if not shape or not 0 <= index < shape[0]:
                raise TensorFileError(f"{self.path}: {name} {shape} has no slice {index}")
            shape = shape[1:]
            step = (end - begin) // entry["shape"][0]
            begin, end = begin + index * step, begin + (index + 1) * step
        out = torch.empty(shape, dtype=dtype)
        if (end - begin) != prod(shape) * dtype.itemsize:
            raise TensorFileError(f"{self.path}: {name} takes {end - begin} bytes, not those of {dtype} {shape}")
        read_into(self._file.fileno(), out, self._start + begin, self.path)
        return out

    def _entry(self, name: str) -> dict:
        entry = self.header.get(name)
        if entry is None:
            raise TensorFileError(f"{self.path}: holds no tensor {name!r}")
        if entry["dtype"] not in DTYPES:
            raise TensorFileError(f"{self.path}: {name} is stored as {entry['dtype']}, which the engine does not read")
        return entry


def read_into(fd: int, out: torch.Tensor, offset: int, path: Path) -> None:
    """Fill the contiguous tensor `out` with the file's bytes from `offset`, read with `os.preadv`, no map."""
    view = memoryview(out.view(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:done + _MAX_READ]], offset + done)
        if got == 0:
            raise TensorFileError(f"{path}: ends before the tensor at byte {offset} does")
        done += got
