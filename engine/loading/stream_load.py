"""Loading a checkpoint tensor by tensor, the routed experts expert by expert, at about the memory of one copy.

transformers' `from_pretrained` builds every experts module as full float tensors and keeps the safetensors
files mapped (the non-expert weights are views of the map), so a model the engine then packs or quantizes is held
about twice at the peak of loading. Here instead:

- the model is built from its config on the meta device (no memory), as `from_pretrained` itself does;
- each checkpoint name is mapped to the model's parameter by transformers' own conversion mapping
  (conversion_mapping.py: its renamings, and the converters that stack per-expert tensors such as Qwen's
  `experts.<e>.gate_proj/up_proj/down_proj.weight` or Mixtral's `w1/w3/w2` into the fused parameters);
- every tensor is read into memory of its own (tensor_reader: no map, so the file's pages are not the process's);
- with `pack`, each experts module's weights go straight into the engine's CPU experts (cpu_experts.CpuExperts),
  one expert at a time, float or quantized (taking the experts `npumoed model quantize` wrote where they exist),
  and the module keeps placeholders, as after the engine packs a loaded model's experts (moe/release.py).

Experts stored in MXFP4 (gpt-oss, mxfp4.py) are dequantized one expert at a time as they are read, so they too
are never held whole in float when packed. A checkpoint this loader cannot read as it is (stored in another
quantized format; a conversion other than stacking experts; a parameter it does not hold) raises `NotStreamable`
before any weight is read, and the caller loads it the way transformers does.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from weakref import ref

import torch
from torch import nn
from transformers import AutoModelForCausalLM, GenerationConfig, PretrainedConfig, PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    Concatenate,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
    rename_source_key,
)

from ..formats.mxfp4 import BLOCKS, MXFP4, SCALES, dequantize_expert, stored_part
from ..formats.quantize import QuantizedWeight, stack_rows
from ..moe.cpu_experts import CpuExperts
from ..moe.experts_layout import ExpertsLayout, engine_form
from ..moe.model_experts import expert_layouts
from ..moe.release import release_weights
from .quant_store import QuantizedReader
from .tensor_reader import TensorFile

_EXPERT_INDEX = re.compile(r"(?:^|\.)experts\.(\d+)\.")


class NotStreamable(Exception):
    """A checkpoint the streaming loader cannot read as it is; the message says why."""


@dataclass(frozen=True)
class _Piece:
    """Where one checkpoint tensor goes in an experts module's parameter: all of it (`expert` None, a fused
    (E, …) tensor), or one expert's rows `part` of `parts` (its gate then its up projection, say). A fused tensor
    stored in MXFP4 is its blocks, `scales` (file, key) its scales."""

    file: str
    key: str
    expert: int | None
    part: int = 0
    parts: int = 1
    scales: tuple[str, str] | None = None


@dataclass
class _Plan:
    plain: dict[str, tuple[str, str]]  # parameter or buffer -> (file, checkpoint key)
    experts: dict[str, dict[str, list[_Piece]]]  # experts module -> its parameter's short name -> pieces


def stream_model(path: Path, config: PretrainedConfig, dtype: torch.dtype, *, experts_implementation: str,
                 pack: bool = False, format: str | None = None, quantized: QuantizedReader | None = None,
                 trust_remote_code: bool = False) -> PreTrainedModel:
    """The model in `path`, its weights read one at a time in `dtype`. With `pack`, every experts module's weights
    go straight into the engine's CPU experts in `format` (None: float), from `quantized` where it holds them.
    models.ModelError when the model is not one the engine runs (checked before any weight is read)."""
    method = _quant_method(config)
    if method not in (None, MXFP4):
        raise NotStreamable(f"its weights are stored quantized ({method})")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation=experts_implementation,
                                                 trust_remote_code=trust_remote_code)
    layouts = {name: layout for name, _, layout in expert_layouts(model)}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise NotStreamable("it has no safetensors files")
    opened = {file.name: TensorFile(file) for file in files}
    try:
        plan = _plan(model, opened, layouts, mxfp4=method == MXFP4)
        for target, (file, key) in plan.plain.items():
            put_tensor(model, target, opened[file].read(key))
        for name, pieces in plan.experts.items():
            module = model.get_submodule(name)
            if pack:
                _pack(module, layouts[name], pieces, opened, format, quantized)
            else:
                for short, held in pieces.items():
                    put_tensor(model, f"{name}.{short}", _whole(getattr(module, short), held, opened))
    finally:
        for file in opened.values():
            file.close()
    model.tie_weights()
    finish_loading(model)
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()


def _quant_method(config: PretrainedConfig) -> str | None:
    """How the checkpoint's weights are stored quantized ("mxfp4", …); None when they are not."""
    quantization = getattr(config, "quantization_config", None)
    if not quantization:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else \
        getattr(quantization, "quant_method", None)
    return str(getattr(method, "value", method)) if method else "an unnamed method"


def _plan(model: PreTrainedModel, opened: dict[str, TensorFile], layouts: dict[str, ExpertsLayout], *,
          mxfp4: bool = False) -> _Plan:
    """Where every checkpoint tensor goes, decided from the headers before any weight is read; with `mxfp4`,
    the experts' MXFP4 blocks and scales too."""
    expected = model.state_dict()
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    plan = _Plan({}, defaultdict(lambda: defaultdict(list)))
    stored: dict[str, dict[str, tuple[str, str]]] = defaultdict(dict)  # MXFP4 parameter -> blocks/scales -> place
    for file, tensors in opened.items():
        for key in tensors.names():
            if mxfp4 and (part := stored_part(key)) is not None:
                target, pattern = rename_source_key(part[0], renamings, converters, model.base_model_prefix,
                                                    expected)
                if target not in expected or pattern is not None or target.rpartition(".")[0] not in layouts:
                    raise NotStreamable(f"its MXFP4 tensor {key} is not a routed experts weight the loader maps")
                stored[target][part[1]] = (file, key)
                continue
            target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, expected)
            if target not in expected:
                if pattern is None:
                    continue  # a tensor the model has no place for: from_pretrained drops it too
                raise NotStreamable(f"its tensor {key} converts to {target}, which the model does not have")
            module, _, short = target.rpartition(".")
            if module not in layouts:
                if pattern is not None:
                    raise NotStreamable(f"its tensor {key} is converted into {target}, which is not routed experts")
                plan.plain[target] = (file, key)
            elif pattern is None:
                plan.experts[module][short].append(_Piece(file, key, None))
            else:
                plan.experts[module][short].append(_expert_piece(file, key, pattern, converters, layouts[module]))
    for target, parts in stored.items():
        if len(parts) != 2:
            raise NotStreamable(f"its MXFP4 {target} has {', '.join(parts)} but not both blocks and scales")
        module, _, short = target.rpartition(".")
        plan.experts[module][short].append(_Piece(*parts[BLOCKS], None, scales=parts[SCALES]))
    missing = set(expected) - set(plan.plain) - set(model.all_tied_weights_keys) - {
        f"{module}.{short}" for module, held in plan.experts.items() for short in held}
    if missing:
        raise NotStreamable(f"the model's {sorted(missing)[0]} (and {len(missing) - 1} more) is not in the checkpoint "
                            "under a name the loader maps")
    for module, held in plan.experts.items():
        for short, pieces in held.items():
            _check_complete(f"{module}.{short}", pieces, expected[f"{module}.{short}"].shape[0])
    return plan


def _expert_piece(file: str, key: str, pattern: str, converters: list[WeightConverter],
                  layout: ExpertsLayout) -> _Piece:
    """The piece of a per-expert tensor that a converter stacks into a fused experts parameter."""
    converter = next(c for c in converters if pattern in c.source_patterns)
    stacks = [type(op) for op in converter.operations] in ([MergeModulelist], [MergeModulelist, Concatenate])
    dims = [getattr(op, "dim", None) for op in converter.operations]
    index = _EXPERT_INDEX.search(key)
    if not stacks or dims not in ([0], [0, 1]) or index is None or layout.transposed:
        raise NotStreamable(f"its tensor {key} is converted by {converter!r}, not by stacking whole experts")
    return _Piece(file, key, int(index.group(1)), converter.source_patterns.index(pattern),
                  len(converter.source_patterns))


def _check_complete(target: str, pieces: list[_Piece], experts: int) -> None:
    whole = [p for p in pieces if p.expert is None]
    if whole and len(pieces) == 1:
        return
    held = {(p.expert, p.part) for p in pieces if p.expert is not None}
    parts = pieces[0].parts
    if whole or len(held) != len(pieces) or held != {(e, k) for e in range(experts) for k in range(parts)}:
        raise NotStreamable(f"the checkpoint does not hold each of {target}'s {experts} experts exactly once")


def _stored_expert(parameter: torch.Tensor, pieces: list[_Piece], expert: int,
                   opened: dict[str, TensorFile]) -> torch.Tensor:
    """One expert's slice of an experts parameter as the module stores it, read from the checkpoint, in the
    parameter's dtype."""
    first = pieces[0]
    if first.scales is not None:  # MXFP4: dequantized as transformers does, into the parameter's dtype
        scales_file, scales_key = first.scales
        blocks, scales = opened[first.file].read(first.key, expert), opened[scales_file].read(scales_key, expert)
        return _checked(parameter, expert, dequantize_expert(blocks, scales, parameter.dtype))
    if first.expert is None:
        stored = opened[first.file].read(first.key, expert)
    else:
        parts = sorted((p for p in pieces if p.expert == expert), key=lambda p: p.part)
        stored = torch.cat([opened[p.file].read(p.key) for p in parts]) if len(parts) > 1 else \
            opened[parts[0].file].read(parts[0].key)
    return _checked(parameter, expert, stored).to(parameter.dtype)


def _checked(parameter: torch.Tensor, expert: int, stored: torch.Tensor) -> torch.Tensor:
    if tuple(stored.shape) != tuple(parameter.shape[1:]):
        raise ValueError(f"expert {expert}'s weight in the checkpoint is {tuple(stored.shape)}, the model's "
                         f"{tuple(parameter.shape[1:])}")
    return stored


def _whole(parameter: torch.Tensor, pieces: list[_Piece], opened: dict[str, TensorFile]) -> torch.Tensor:
    """An experts parameter (E, …) read expert by expert into one tensor of its own."""
    out = torch.empty(parameter.shape, dtype=parameter.dtype)
    for expert in range(parameter.shape[0]):
        out[expert] = _stored_expert(parameter, pieces, expert, opened)
    return out


def _pack(module: nn.Module, layout: ExpertsLayout, pieces: dict[str, list[_Piece]], opened: dict[str, TensorFile],
          format: str | None, quantized: QuantizedReader | None) -> None:
    """Read the module's experts one at a time into the engine's CPU experts, and leave the module placeholders."""
    names = layout.weight_names  # each in `pieces`: the plan found every parameter in the checkpoint
    up_name = names[0]
    up, down = (getattr(module, name) for name in names)
    stored_biases = tuple(_whole(getattr(module, f"{name}_bias"), pieces[f"{name}_bias"], opened)
                          for name in names) if layout.bias else ()
    # the biases in the engine's form: the weights' share of this is on the meta device, and costs nothing
    biases = engine_form(layout, up, down, *stored_biases)
    # the quantized store holds per-expert linear weights, which modules of these layouts stack unchanged
    store = quantized if quantized is not None and not (layout.transposed or layout.interleaved) else None

    def experts() -> Iterator[tuple[torch.Tensor | QuantizedWeight, torch.Tensor | QuantizedWeight]]:
        for e in range(up.shape[0]):
            given = _quantized_expert(pieces, names, e, store) if store is not None else None
            if given is not None:
                yield given
                continue
            stored = (_stored_expert(up, pieces[up_name], e, opened), _stored_expert(down, pieces["down_proj"], e,
                                                                                     opened))
            weights = engine_form(layout, *(w[None] for w in stored))
            yield weights.gate_up[0], weights.down[0]

    cpu = CpuExperts.streamed(experts(), up.dtype, layout, format, biases.gate_up_bias, biases.down_bias)
    for name, bias in zip(names, stored_biases, strict=False):
        setattr(module, f"{name}_bias", nn.Parameter(bias, requires_grad=False))
    attach_packed(module, names, cpu)


def attach_packed(module: nn.Module, names: tuple[str, str], cpu: CpuExperts) -> None:
    """Leave the experts module placeholders for its weights `names`, and `cpu` as their packed copy."""
    release_weights(module, names, cpu)
    module._npumoe_packed = ref(cpu)  # the runtime finds this copy packed already


def _quantized_expert(pieces: dict[str, list[_Piece]], names: tuple[str, str], expert: int,
                      quantized: QuantizedReader) -> tuple[QuantizedWeight, QuantizedWeight] | None:
    """One expert's gate-up and down weights from the quantized store, when it holds every part of both
    (quantization is row by row, so the gate's and the up's stacked are the gate-up's)."""
    keys = [[p.key for p in sorted(pieces[name], key=lambda p: p.part) if p.expert == expert] for name in names]
    if not all(keys) or not all(key in quantized for held in keys for key in held):
        return None
    up, down = ([quantized.weight(key) for key in held] for held in keys)
    return stack_rows(up), stack_rows(down)


def put_tensor(model: PreTrainedModel, target: str, value: torch.Tensor) -> None:
    """Put a tensor read from the checkpoint in the place of the model's empty parameter or buffer `target`."""
    module_name, _, leaf = target.rpartition(".")
    module = model.get_submodule(module_name)
    current = module._parameters.get(leaf)
    held = current if current is not None else module._buffers[leaf]
    if tuple(value.shape) != tuple(held.shape):
        raise ValueError(f"{target} is {tuple(value.shape)} in the checkpoint, {tuple(held.shape)} in the model")
    value = value.to(held.dtype)
    if current is not None:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value


def finish_loading(model: PreTrainedModel) -> None:
    """Make the buffers no checkpoint holds (rotary frequencies, say) as transformers does after loading: every
    weight marked as loaded, so that only they are initialised."""
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.device.type != "meta":
            tensor._is_hf_initialized = True
    model._move_missing_keys_from_meta_to_device(set(), None, None, None)
    model._initialize_missing_keys(is_quantized=False)
    left = [name for name, tensor in (*model.named_parameters(), *model.named_buffers()) if tensor.is_meta]
    if left:
        raise ValueError(f"{left[0]} was left without a value after loading")
