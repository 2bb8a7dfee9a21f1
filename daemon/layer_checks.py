"""A check that runs before every MoE layer of the model: how a stop or the watchdog interrupts a long chunk.

A chunk of a large model on a CPU can take minutes; the service manager waits only its stop timeout before
SIGKILL. So the worker's cheap check (stopping? stalled?) also runs as a forward pre-hook on each of the
model's experts modules, which raises out of the forward pass; the job then goes back to the queue. Hooks
are torch's own: no model code is patched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from npumoe.engine import Engine, EngineSettings
    from npumoe.jobs.pipeline import Model

_HOOKED = "_npumoed_layer_check"  # set on an engine once its layers carry the check


class LayerChecked:
    """The pipeline's model (see pipeline.Model), whose engine runs `check` before every MoE layer."""

    def __init__(self, model: Model, check: Callable[[], None]) -> None:
        self.model = model
        self.check = check

    @property
    def settings(self) -> EngineSettings:
        return self.model.settings

    def load(self) -> Engine:
        engine = self.model.load()
        if not getattr(engine, _HOOKED, False):
            from npumoe.engine import Engine
            from npumoe.engine.moe.model_experts import moe_experts

            if isinstance(engine, Engine):  # a stand-in engine in a test has no layers to check
                for _, experts in moe_experts(engine.loaded.model):
                    experts.register_forward_pre_hook(lambda *_: self.check())
                setattr(engine, _HOOKED, True)
        return engine
