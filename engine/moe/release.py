"""Releasing a module's weights once the engine holds them packed: the one placeholder, used for experts and
dense projections alike.

A released weight becomes a placeholder of the same shape and dtype over one element (stride 0), so the module
still reads as the same layout while its memory is gone; the module then holds the packed copy
(`_npumoe_owned`) for as long as the model lives, so the weights exist once, in the engine's form.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class PackedCopy(Protocol):
    """What holds a module's weights packed: it is told when the module's weights become placeholders."""

    def now_from(self, *weights: torch.Tensor) -> None: ...


def weights_identity(*weights: torch.Tensor) -> tuple:
    """Where each weight lives and how often it has been written to in place (torch counts that, except for
    tensors made in inference mode, which can be written only inside it)."""
    return tuple((w.data_ptr(), w.shape, w.stride(), w.dtype, 0 if w.is_inference() else w._version)
                 for w in weights)


def placeholder(weight: torch.Tensor) -> nn.Parameter:
    """A stand-in for `weight`: the same shape, dtype and device over one element (in memory for a weight on
    the meta device, which the streaming loader never gave values)."""
    device = "cpu" if weight.is_meta else weight.device
    return nn.Parameter(torch.zeros((), dtype=weight.dtype, device=device).expand(weight.shape), requires_grad=False)


def is_placeholder(weight: torch.Tensor) -> bool:
    """Whether `weight` is a released weight's placeholder (one element seen at every index), not values."""
    return weight.numel() > 1 and not any(weight.stride())


def release_weights(module: nn.Module, names: tuple[str, ...], packed: PackedCopy) -> None:
    """Free the module's weights `names` now that `packed` holds them: each becomes a placeholder, and the module
    holds `packed` from now on. A module released before is left as it is."""
    if released(module):
        return
    for name in names:
        setattr(module, name, placeholder(getattr(module, name)))
    packed.now_from(*(getattr(module, name) for name in names))
    module._npumoe_owned = packed


def released(module: nn.Module) -> bool:
    return hasattr(module, "_npumoe_owned")
