"""Each decoder layer's output, caught as a prefill runs: an exactness check per layer, not only on the last."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import PreTrainedModel


@contextmanager
def layer_outputs(model: PreTrainedModel) -> Iterator[list[list[torch.Tensor]]]:
    """Inside the block every call of each decoder layer appends its output hidden states (n, H) to that layer's
    list: one list per layer, in depth order."""
    layers = decoder_layers(model)
    caught: list[list[torch.Tensor]] = [[] for _ in layers]
    hooks = [layer.register_forward_hook(lambda _m, _in, out, into=into: into.append(_hidden(out)[0]))
             for layer, into in zip(layers, caught, strict=True)]
    try:
        yield caught
    finally:
        for hook in hooks:
            hook.remove()


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    layers = getattr(model.base_model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"{type(model).__name__} keeps no decoder layers at base_model.layers to check one by one")
    return layers


def _hidden(output: object) -> torch.Tensor:
    """A decoder layer's hidden states, whether it returns them alone or first in a tuple (older families)."""
    return output if isinstance(output, torch.Tensor) else output[0]
