"""The NPUMoE engine: MoE prefill on static-shape accelerators (knows nothing of files or queues)."""

from .engine import DocumentResult, Engine, EngineSettings, Progress, RunStats
from .models import SUPPORTED_FAMILIES, LoadedModel, ModelError, load_model
from .plan import ExpertPlan, PlanError

__all__ = [
    "SUPPORTED_FAMILIES",
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
