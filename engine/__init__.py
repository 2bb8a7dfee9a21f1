"""The NPUMoE engine: MoE prefill on static-shape accelerators (knows nothing of files or queues).

The names below load on first use (PEP 562), so that the engine's torch-free modules, such as
`npumoe.engine.vocabulary`, can be imported by config and `npumoed status` without loading torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import DocumentResult, Engine, EngineSettings, Progress, RunStats
    from .errors import ModelError
    from .loading.load import LoadedModel, load_model
    from .plan.expert_plan import ExpertPlan, PlanError

# Each exported name and the module of the engine that defines it.
_HOMES = {
    "DocumentResult": "api", "Engine": "api", "EngineSettings": "api", "Progress": "api", "RunStats": "api",
    "LoadedModel": "loading.load", "ModelError": "errors", "load_model": "loading.load",
    "ExpertPlan": "plan.expert_plan", "PlanError": "plan.expert_plan",
}

__all__ = [
    "DocumentResult",
    "Engine",
    "EngineSettings",
    "ExpertPlan",
    "LoadedModel",
    "ModelError",
    "PlanError",
    "Progress",
    "RunStats",
    "load_model",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value
