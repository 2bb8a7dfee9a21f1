"""What a model's weights take in memory in each format, from its config and safetensors headers alone.

In fp32 and bf16 every weight is in that dtype. In int8 and int4 the routed experts' weights are quantized
(quantize.py: int8 with a float32 scale per output row; int4 in groups of INT4_GROUP with a bf16 scale and
zero each, 5 bits a weight) and everything else stays bf16 (embeddings, norms, attention, routers; the biases
of experts too). A checkpoint is counted from its safetensors headers (no weight is read); a config alone from
the model built on the meta device (no memory allocated). Experts a checkpoint stores in MXFP4 (gpt-oss) count
as the (E, out, in) weights they dequantize to; their scales are not counted, as each format has its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..formats.mxfp4 import BLOCKS, dequantized_shape, stored_part
from ..formats.quantize import INT4, INT4_GROUP, INT8
from .gguf_header import read_gguf
from .gguf_load import EXPERTS_TENSOR, gguf_shape, is_gguf
from .quant_store import is_expert_weight, read_header

FP32, BF16 = "fp32", "bf16"
SIZE_FORMATS = (FP32, BF16, INT8, INT4)
_FLOAT_BYTES = {FP32: 4, BF16: 2}
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    expert: bool  # a routed expert's weight, quantized in int8 and int4

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


@dataclass(frozen=True)
class FormatSize:
    format: str
    expert_bytes: int
    other_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.expert_bytes + self.other_bytes


@dataclass(frozen=True)
class ModelSize:
    parameters: int
    expert_parameters: int
    formats: dict[str, FormatSize]


def tensor_bytes(tensor: Tensor, format: str) -> int:
    """One tensor's bytes in `format`."""
    if format in _FLOAT_BYTES:
        return tensor.numel * _FLOAT_BYTES[format]
    if not tensor.expert:
        return tensor.numel * _FLOAT_BYTES[BF16]
    rows = tensor.numel // tensor.shape[-1]  # output rows of each expert's (out, in) weight, all experts
    if format == INT8:
        return tensor.numel + rows * 4
    return tensor.numel // 2 + tensor.numel // INT4_GROUP * 2 * 2


def model_size(tensors: Iterable[Tensor]) -> ModelSize:
    held = list(tensors)
    formats = {format: FormatSize(format, sum(tensor_bytes(t, format) for t in held if t.expert),
                                  sum(tensor_bytes(t, format) for t in held if not t.expert))
               for format in SIZE_FORMATS}
    return ModelSize(sum(t.numel for t in held), sum(t.numel for t in held if t.expert), formats)


def checkpoint_tensors(folder: Path) -> list[Tensor]:
    """The tensors of a checkpoint folder's safetensors files (or of a GGUF file), from their headers."""
    if is_gguf(folder):
        return [Tensor(t.name, gguf_shape(t), EXPERTS_TENSOR.fullmatch(t.name) is not None)
                for t in read_gguf(folder).tensors]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no safetensors files")
    tensors = []
    for path in files:
        for name, entry in read_header(path).items():
            if name == "__metadata__":
                continue
            if entry["dtype"] not in _DTYPE_BYTES:
                raise ValueError(f"{path}: tensor {name} has dtype {entry['dtype']}, which this count does not know")
            mxfp4 = stored_part(name) if entry["dtype"] == "U8" else None
            if mxfp4 is None:
                tensors.append(Tensor(name, tuple(entry["shape"]),
                                      is_expert_weight(name, entry["shape"], entry["dtype"])))
            elif mxfp4[1] == BLOCKS:
                tensors.append(Tensor(mxfp4[0], dequantized_shape(entry["shape"]), True))
    return tensors


def config_tensors(config: Mapping[str, Any]) -> list[Tensor]:
    """The parameters of the model a config.json describes, built on the meta device. Its routed experts are
    the weights (not biases) under an `experts` module, counted (E, out, in) as the engine quantizes them (its
    rows are output channels), whichever way round transformers holds them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(config)
    family = settings.pop("model_type", None)
    if not family:
        raise ValueError("the config has no model_type")
    built = AutoConfig.for_model(family, **settings)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(built)
    tensors = []
    for name, parameter in model.named_parameters():
        shape = tuple(parameter.shape)
        expert = ".experts." in f".{name}" and parameter.ndim >= 2 and not name.endswith("bias")
        if expert and getattr(model.get_submodule(name.rpartition(".")[0]), "is_transposed", False):
            shape = (*shape[:-2], shape[-1], shape[-2])  # stored (E, in, out)
        tensors.append(Tensor(name, shape, expert))
    return tensors


# What loading and running a model needs beyond its weights' bytes: peak RSS while loading and processing a
# document is bounded by 1.15 x the weights (issue #15's measure, KV cache and activations of a 2,048-token
# document included), plus the interpreter, torch and transformers (0.24 GiB measured on Linux, rounded up).
RUN_OVERHEAD = 1.15
PROCESS_BYTES = 2**29
# What the machine keeps for the system and the person's own programs: the daemon runs beside them.
RESERVE_SHARE, MIN_RESERVE_BYTES = 0.25, 2 * 2**30


def needed_bytes(weights: int) -> int:
    """Memory a model whose weights take `weights` bytes needs to run here."""
    return int(weights * RUN_OVERHEAD) + PROCESS_BYTES


def usable_bytes(total_memory: int) -> int:
    """What a machine with `total_memory` bytes of RAM leaves the daemon."""
    return total_memory - max(MIN_RESERVE_BYTES, int(total_memory * RESERVE_SHARE))
