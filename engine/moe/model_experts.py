"""Which modules of a loaded model are its routed experts, and in which layout each stores its weights."""

from __future__ import annotations

from torch import nn

from ..errors import ModelError
from .experts_layout import ExpertsLayout, LayoutError, is_experts_module, read_layout


def moe_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's routed-experts modules, in forward order, as (qualified name, module); `ModelError` when
    it has none, or one whose layout the engine does not implement (`moe_layouts`)."""
    return [(name, module) for name, module, _ in moe_layouts(model)]


def moe_layouts(model: nn.Module) -> list[tuple[str, nn.Module, ExpertsLayout]]:
    """Each routed-experts module, in forward order, with its layout (experts_layout.read_layout)."""
    found = []
    for name, module in model.named_modules():
        if not is_experts_module(module):
            continue
        try:
            found.append((name, module, read_layout(name, module)))
        except LayoutError as e:
            raise ModelError(str(e)) from e
    if not found:
        raise ModelError(f"{type(model).__name__} has no routed-experts modules (none is wrapped by transformers' "
                         "experts interface), so it is not an MoE model the engine can run")
    return found
