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
    """Each routed-experts module, in forward order, with its layout (experts_layout.read_layout); `ModelError`
    when it has none (what plans, group graphs and calibration need)."""
    found = expert_layouts(model)
    if not found:
        raise ModelError(f"{type(model).__name__} has no routed-experts modules (none is wrapped by transformers' "
                         "experts interface): a dense model, whose FFN every token takes, has no experts to plan")
    return found


def expert_layouts(model: nn.Module) -> list[tuple[str, nn.Module, ExpertsLayout]]:
    """As `moe_layouts`, but empty for a dense model (the engine runs those too, with no experts to route);
    `ModelError` for experts in a layout the engine does not implement."""
    found = []
    for name, module in model.named_modules():
        if not is_experts_module(module):
            continue
        try:
            found.append((name, module, read_layout(name, module)))
        except LayoutError as e:
            raise ModelError(str(e)) from e
    return found
