"""The benchmarks' work, made the same way in whichever process runs it: the whole model a prefill runs and its
per-layer outputs, so that transformers in a process of its own (own_process.py) does the very same work."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from itertools import chain

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from npumoe.engine.generate.prefill import new_cache, prefill
from npumoe.engine.synthetic.geometry import Geometry, family_config

from ..paths import Output
from .layers import layer_outputs


def build_model(geometry: Geometry, layers: int, dtype: torch.dtype, *, context: int, seed: int) -> PreTrainedModel:
    """The family's causal LM with `layers` layers at this geometry, randomly initialised the family's way."""
    config = family_config(geometry, layers=layers, experts_implementation="eager",
                           max_position_embeddings=context)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def prefill_parts(model: PreTrainedModel, ids: Sequence[int], chunk_tokens: int) -> tuple[torch.Tensor, ...]:
    """`ids` prefilled in chunks with the KV cache carried: the hidden states after each decoder layer for the
    whole document, then the final (normed) ones, each (T, H)."""
    with layer_outputs(model) as layers:
        final = torch.cat(list(prefill(model, ids, chunk_tokens, new_cache(model))))
    return (*(torch.cat(chunks) for chunks in layers), final)


def in_float32(model: nn.Module, run: Callable[[], Output]) -> Output:
    """`run()` with the module's floating-point weights in fp32, then each back in its own dtype (bf16 to fp32 and
    back is exact): the truth a bf16 run's rounding is measured from. `run` gives its inputs in fp32 itself."""
    dtypes = {name: tensor.dtype for name, tensor in _tensors(model)}
    model.float()
    try:
        return run()
    finally:
        for name, tensor in _tensors(model):
            if tensor.dtype != dtypes[name]:
                tensor.data = tensor.data.to(dtypes[name])


def _tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    return chain(model.named_parameters(), model.named_buffers())
