"""What a GGUF model's header says about it, and whether the engine runs it; no tensor data is read."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf

from .gguf_header import read_gguf
from .gguf_load import EXPERTS_TENSOR, GGUF_ARCHITECTURES
from .model_size import ModelSize, checkpoint_tensors, model_size

# What gguf's reader raises on a file that is not GGUF or ends inside its header (numpy reading past the end).
HEADER_ERRORS = (OSError, ValueError, KeyError, IndexError, TypeError)


@dataclass(frozen=True)
class GgufSummary:
    architecture: str  # llama.cpp's name: qwen3moe, llama, …
    quantization: str  # the file type llama.cpp recorded (Q4_K_M), else the block type of most of its bytes
    experts: bool  # it stores routed experts (`ffn_*_exps`)
    size: ModelSize  # its parameters, and what it needs in each of the engine's formats
    disk_bytes: int


def summarize(files: Sequence[Path]) -> GgufSummary:
    """The model in `files` (one GGUF file, or each part of a split one); HEADER_ERRORS for one that is unreadable
    or not GGUF."""
    readers = [read_gguf(path) for path in files]
    first = readers[0]  # a split model's metadata is in its first part
    architecture = _field(first, "general.architecture")
    if not isinstance(architecture, str):
        raise ValueError("its header names no architecture (general.architecture)")
    tensors = [tensor for path in files for tensor in checkpoint_tensors(path)]
    return GgufSummary(architecture, _quantization(readers), any(EXPERTS_TENSOR.fullmatch(t.name) for t in tensors),
                       model_size(tensors), sum(path.stat().st_size for path in files))


def not_runnable(summary: GgufSummary) -> str | None:
    """Why the engine does not run this model (None: it does)."""
    if summary.architecture not in GGUF_ARCHITECTURES.values():
        return (f"the engine does not read {summary.architecture} GGUF files (it reads "
                f"{', '.join(sorted(GGUF_ARCHITECTURES.values()))})")
    if not summary.experts:
        return f"a dense {summary.architecture} model: the engine runs mixture-of-experts models"
    return None


def _quantization(readers: list[gguf.GGUFReader]) -> str:
    file_type = _field(readers[0], "general.file_type")
    try:
        return gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        pass  # not recorded (or a type newer than this gguf package): what the tensors are stored in
    held: Counter[str] = Counter()
    for reader in readers:
        for tensor in reader.tensors:
            held[gguf.GGMLQuantizationType(tensor.tensor_type).name] += int(tensor.n_bytes)
    return held.most_common(1)[0][0] if held else "none"


def _field(reader: gguf.GGUFReader, key: str) -> object:
    field = reader.fields.get(key)
    return None if field is None else field.contents()
