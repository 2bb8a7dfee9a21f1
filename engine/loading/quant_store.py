"""Quantized experts on disk: written from a checkpoint one tensor at a time, read back memory-mapped.

`quantize_checkpoint` reads each safetensors file of a checkpoint with safetensors' `safe_open` (memory-mapped)
and writes, per file, a safetensors file of its routed experts' weights quantized (quantize.py), streaming: the
output header is known from the input's before any weight is read, so each quantized tensor goes to disk as
soon as it is made. Nothing is held but the tensor at hand and its codes.

Only the experts are written. The other tensors (embeddings, attention, norms, routers, shared experts) are
referenced in the original checkpoint, not copied: the quantized experts are of no use without it (its config
and tokenizer too), and copying them would double the disk the non-expert part takes. The manifest records the
checkpoint's folder and fingerprint, and `load_quantized` refuses experts made from other weights.

Expert weights are recognised by name, as checkpoints store them one expert at a time: a 2-D `…weight` under
`experts.<index>.`, the (out, in) layout of a linear layer (Qwen2/3-MoE, Mixtral, OLMoE, PhiMoE, DeepSeek,
GLM-4 MoE). Fused 3-D expert tensors (GraniteMoE, gpt-oss) stay in the original, unquantized.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from ..formats.quantize import INT4, INT4_GROUP, INT8, QuantizedWeight, check_format, int4_fits, quantize
from . import tensor_reader
from .resolve import fingerprint
from .tensor_reader import TensorFile, TensorFileError

MANIFEST = "quantization.json"
VERSION = 1
_EXPERT_WEIGHT = re.compile(r"(^|\.)experts\.\d+\.[^.]+\.weight$")
_FLOATS = {"F32", "F16", "BF16"}
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "I8": torch.int8, "U8": torch.uint8}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


class QuantizedStoreError(ValueError):
    """Quantized experts that cannot be made or used (a bad checkpoint, a stale or damaged store)."""


def is_expert_weight(name: str, shape: list[int], dtype: str, *, format: str = INT8,
                     group: int = INT4_GROUP) -> bool:
    """Whether a checkpoint tensor is a routed expert's linear weight that `format` can hold."""
    if not (_EXPERT_WEIGHT.search(name) and len(shape) == 2 and dtype in _FLOATS):
        return False
    return format != INT4 or int4_fits(shape[1], group)


def read_header(path: Path) -> dict[str, dict]:
    """A safetensors file's header: {name: {"dtype", "shape", "data_offsets"}} (and "__metadata__"), read
    without touching its tensors."""
    try:
        return tensor_reader.read_header(path)
    except TensorFileError as e:
        raise QuantizedStoreError(str(e)) from e


def quantized_folder(models: Path, checkpoint: Path, fingerprint: str, format: str) -> Path:
    """Where the home keeps a checkpoint's experts quantized to `format`: under models/quantized/, by the
    checkpoint's folder name and its weights' fingerprint (other weights, another folder)."""
    return models / "quantized" / f"{checkpoint.name}-{fingerprint}" / format


def _quantized_shapes(shape: list[int], format: str, group: int) -> dict[str, tuple[torch.dtype, list[int]]]:
    n, k = shape
    if format == INT8:
        return {"codes": (torch.int8, [n, k]), "scale": (torch.float32, [n])}
    groups = [n, k // group]
    return {"codes": (torch.uint8, [n, k // 2]), "scale": (torch.bfloat16, groups), "zero": (torch.bfloat16, groups)}


@dataclass(frozen=True)
class QuantizeReport:
    target: Path
    experts: int  # weights quantized
    kept: int  # tensors left in the original
    source_bytes: int  # the experts' bytes in the checkpoint
    quantized_bytes: int


def quantize_checkpoint(source: Path, target: Path, format: str, *, group: int = INT4_GROUP,
                        progress: Callable[[int, int], None] | None = None) -> QuantizeReport:
    """Write `source`'s expert weights quantized to `format` into the folder `target` (replaced whole once
    complete), one tensor at a time; `progress(done, total)` after each."""
    check_format(format)
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise QuantizedStoreError(f"{source}: no safetensors files to quantize")
    headers = {path.name: read_header(path) for path in files}
    plans = {name: {tensor: entry["shape"] for tensor, entry in header.items() if tensor != "__metadata__"
                    and is_expert_weight(tensor, entry["shape"], entry["dtype"], format=format, group=group)}
             for name, header in headers.items()}
    if not sum(map(len, plans.values())):
        raise QuantizedStoreError(f"{source}: no routed expert weights found (expected 2-D tensors named "
                                  "…experts.<index>.<name>.weight)")

    def quantized(name: str) -> Iterator[tuple[QuantizedWeight, int]]:
        with safe_open(str(source / name), framework="pt") as reader:
            for tensor in plans[name]:
                weight = reader.get_tensor(tensor)
                size = weight.numel() * weight.element_size()
                codes = quantize(weight, format, group=group)
                del weight  # only the codes are held while they are written
                yield codes, size

    kept = sum(len(h) - ("__metadata__" in h) for h in headers.values()) - sum(map(len, plans.values()))
    return write_store(source, target, format, plans, quantized, kept=kept, group=group, progress=progress)


def write_store(source: Path, target: Path, format: str, plans: dict[str, dict[str, list[int]]],
                quantized: Callable[[str], Iterator[tuple[QuantizedWeight, int]]], *, kept: int,
                group: int = INT4_GROUP, progress: Callable[[int, int], None] | None = None) -> QuantizeReport:
    """Write the quantized experts of the checkpoint (or GGUF file) `source` into the folder `target`, replaced
    whole once complete: per file name of `plans`, its tensors' (N, K) weights, which `quantized(file name)` yields
    in that order, each with the bytes it took in the source; `progress(done, total)` after each."""
    total = sum(map(len, plans.values()))
    done = source_bytes = quantized_bytes = 0
    with StoreWriter(source, target, format, plans, group=group) as store:
        for name, plan in plans.items():
            if not plan:
                continue
            for tensor, (weight, size) in zip(plan, quantized(name), strict=True):
                store.write(name, tensor, weight)
                source_bytes += size
                quantized_bytes += weight.nbytes
                done += 1
                if progress:
                    progress(done, total)
        store.commit()
    return QuantizeReport(target, total, kept, source_bytes, quantized_bytes)


class StoreWriter:
    """Quantized experts written into the folder `target` as they come, in `plans`' order (per file name, its
    tensors' (N, K) shapes): into a temporary folder beside it, which `commit` renames to `target` (replacing
    it) once every tensor is written; left without a commit, nothing is kept. A load that converts a GGUF file's
    experts keeps them so (gguf_load), as `npumoed model quantize` does (`write_store`)."""

    def __init__(self, source: Path, target: Path, format: str, plans: dict[str, dict[str, list[int]]], *,
                 group: int = INT4_GROUP) -> None:
        check_format(format)
        self.source, self.target, self.format, self.group = source, target, format, group
        self.plans = {name: plan for name, plan in plans.items() if plan}
        target.parent.mkdir(parents=True, exist_ok=True)
        self._partial = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
        self._name: str | None = None
        self._file: _SafetensorsWriter | None = None
        self.abandoned = False

    def write(self, name: str, tensor: str, weight: QuantizedWeight) -> None:
        """Write file `name`'s next tensor, `tensor`: the one its plan announced next (nothing once abandoned)."""
        if self.abandoned:
            return
        if name != self._name:
            self._close()
            layout = {f"{held}.{part}": spec for held, shape in self.plans[name].items()
                      for part, spec in _quantized_shapes(shape, self.format, self.group).items()}
            self._name, self._file = name, _SafetensorsWriter(self._partial / name, layout, {"format": self.format})
        for part, value in weight.tensors().items():
            self._file.write(f"{tensor}.{part}", value)

    def abandon(self) -> None:
        """Keep nothing, and write nothing more: what a load does when the disk refuses the store (it runs on)."""
        self.abandoned = True
        self.__exit__(None, None, None)

    def commit(self) -> None:
        """Keep what was written as `target`, with its manifest (refused unless every announced tensor came); nothing
        once abandoned."""
        if self.abandoned:
            return
        self._close()
        missing = [name for name in self.plans if not (self._partial / name).is_file()]
        if missing:
            raise QuantizedStoreError(f"{self.target}: {', '.join(missing)} not written")
        manifest = {"version": VERSION, "format": self.format, "group": self.group if self.format == INT4 else None,
                    "source": str(self.source.resolve()), "fingerprint": fingerprint(self.source),
                    "files": {name: sorted(plan) for name, plan in self.plans.items()}}
        (self._partial / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if self.target.exists():
            shutil.rmtree(self.target)
        os.rename(self._partial, self.target)

    def _close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            file.finish()

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, *failure: object) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            file.close()
        shutil.rmtree(self._partial, ignore_errors=True)  # gone already where committed


class _SafetensorsWriter:
    """A safetensors file written tensor by tensor: the header, from the layout given, goes first; each tensor
    must then come in the layout's order, with the shape and dtype it announced."""

    def __init__(self, path: Path, layout: dict[str, tuple[torch.dtype, list[int]]], metadata: dict[str, str]):
        self.path, self.layout = path, layout
        header: dict[str, object] = {"__metadata__": metadata}
        offset = 0
        for name, (dtype, shape) in layout.items():
            size = int(np.prod(shape)) * dtype.itemsize
            header[name] = {"dtype": _NAMES[dtype], "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # tensors start 8-byte aligned
        self._order: Iterator[str] = iter(layout)
        self._file = path.open("wb")
        self._file.write(struct.pack("<Q", len(encoded)) + encoded)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = next(self._order, None)
        dtype, shape = self.layout[name]
        if name != expected or tensor.dtype != dtype or list(tensor.shape) != shape:
            raise QuantizedStoreError(f"{self.path}: {name} {tensor.dtype} {list(tensor.shape)} is not the next "
                                      f"tensor announced ({expected})")
        self._file.write(tensor.contiguous().view(torch.uint8).numpy())  # its bytes, not a copy of them

    def close(self) -> None:
        self._file.close()

    def finish(self) -> None:
        """Close the file, refused unless every tensor announced came."""
        self.close()
        if next(self._order, None) is not None:
            raise QuantizedStoreError(f"{self.path}: written before every announced tensor came")


@dataclass(frozen=True)
class QuantizedExperts:
    """A checkpoint's quantized expert weights, by their name in the checkpoint, memory-mapped from disk."""

    format: str
    source: Path
    weights: dict[str, QuantizedWeight]


def load_quantized(target: Path, source: Path | None = None) -> QuantizedExperts:
    """The quantized experts in `target`, their tensors memory-mapped (read from disk as they are used); refused
    if `source` (by default the checkpoint they were made from) no longer holds the weights they were made from."""
    format, files, source = _checked_manifest(target, source)
    weights = {}
    for name, tensors in files.items():
        held = _mapped(target / name)
        for tensor in tensors:
            weights[tensor] = _weight(format, tensor, held)
    return QuantizedExperts(format, source, weights)


class QuantizedReader:
    """Quantized experts read one weight at a time into memory of their own (tensor_reader), for loading a model:
    the experts are packed from them, and a map of the files would count in the process beside the packed copy."""

    def __init__(self, target: Path, source: Path | None = None) -> None:
        self.target = target
        self.format, files, self.source = _checked_manifest(target, source)
        self._file_of = {tensor: name for name, tensors in files.items() for tensor in tensors}
        self._open: dict[str, TensorFile] = {}

    def __contains__(self, tensor: str) -> bool:
        return tensor in self._file_of

    def weight(self, tensor: str) -> QuantizedWeight:
        """The quantized weight of checkpoint tensor `tensor`."""
        name = self._file_of[tensor]
        if name not in self._open:
            self._open[name] = TensorFile(self.target / name)
        held = self._open[name]
        try:
            return _weight(self.format, tensor, _Parts(held))
        except TensorFileError as e:
            raise QuantizedStoreError(f"{self.target}: {e}") from e

    def close(self) -> None:
        for file in self._open.values():
            file.close()
        self._open.clear()


class _Parts:
    """The stored parts of one quantized tensor in an open file, read when asked for."""

    def __init__(self, file: TensorFile) -> None:
        self.file = file

    def __contains__(self, key: str) -> bool:
        return key in self.file.header

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.file.read(key)


def find_quantized(models: Path, checkpoint: Path, format: str) -> QuantizedReader | None:
    """The experts `npumoed model quantize` wrote for this checkpoint in `format` under the home's `models`
    folder, or None when there are none for its current weights."""
    target = quantized_folder(models, checkpoint, fingerprint(checkpoint), format)
    if not (target / MANIFEST).is_file():
        return None
    reader = QuantizedReader(target, checkpoint)
    if reader.format != format:
        raise QuantizedStoreError(f"{target}: holds {reader.format} experts, not {format}; quantize again")
    return reader


def _checked_manifest(target: Path, source: Path | None) -> tuple[str, dict[str, list[str]], Path]:
    """(format, {file: tensors}, checkpoint) of the quantized experts in `target`, refused if the checkpoint
    (`source`, by default the one named in the manifest) no longer holds the weights they were made from."""
    try:
        manifest = json.loads((target / MANIFEST).read_text())
        format, files = manifest["format"], manifest["files"]
        source = Path(source or manifest["source"])
        if manifest["version"] != VERSION:
            raise QuantizedStoreError(f"{target}: quantized with format version {manifest['version']}, this "
                                      f"engine reads {VERSION}; quantize again")
        check_format(format)
    except (OSError, ValueError, KeyError, TypeError) as e:
        if isinstance(e, QuantizedStoreError):
            raise
        raise QuantizedStoreError(f"{target}: no readable quantized experts ({e})") from e
    # a checkpoint folder, or a GGUF file (its config is in its metadata)
    if not (source.is_file() or (source / "config.json").is_file()) or fingerprint(source) != manifest["fingerprint"]:
        raise QuantizedStoreError(f"{target}: made from other weights than those now in {source}; quantize again")
    return format, files, source


def _weight(format: str, tensor: str, held: dict[str, torch.Tensor] | _Parts) -> QuantizedWeight:
    """One quantized weight from its stored parts ("<tensor>.codes", ".scale", ".zero") in `held`."""
    parts = {part: held[f"{tensor}.{part}"] for part in ("codes", "scale", "zero") if f"{tensor}.{part}" in held}
    return QuantizedWeight.from_tensors(format, parts)


def _mapped(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, as views of one copy-on-write memory map of it."""
    header = read_header(path)
    with path.open("rb") as file:
        (size,) = struct.unpack("<Q", file.read(8))
    data = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c", offset=8 + size))
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        tensors[name] = data[begin:end].view(_DTYPES[entry["dtype"]]).reshape(entry["shape"])
    return tensors
