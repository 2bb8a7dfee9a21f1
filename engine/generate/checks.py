"""The caller's check, run before every MoE layer (every decoder layer of a dense model): how a stop or a pause
reaches a long chunk or a summary.

A chunk of a large model on a CPU can take minutes, and every decode step of a summary or a combine runs each
layer once, so a check before each MoE layer of every forward pass makes a stop (the check raises) or a pause
(it blocks) take effect within one layer of a prefill chunk or of a decode step. The hooks are torch's own
forward pre-hooks on the experts modules (a dense model's decoder layers): no model code is patched, and they are
removed when the call ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import nn

from ..moe.model_experts import expert_layouts

Check = Callable[[], None]  # returns to go on, blocks to pause, raises to stop (the exception propagates)


@contextmanager
def checked(model: nn.Module, check: Check | None) -> Iterator[None]:
    """Within the block, `check()` runs before every routed-experts layer of `model` (every decoder layer of a
    dense one); None: no check."""
    if check is None:
        yield
        return
    modules = [experts for _, experts, _ in expert_layouts(model)] or list(model.base_model.layers)
    handles = [module.register_forward_pre_hook(lambda *_: check()) for module in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
