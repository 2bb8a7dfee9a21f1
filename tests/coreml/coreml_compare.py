"""Running one tiny model's plan through the coreml backend and through torch-static, to compare them."""

from __future__ import annotations

from pathlib import Path

import torch

from npumoe.engine.attach.runtime import MoeRuntime
from npumoe.engine.backends.base import TorchStaticBackend
from npumoe.engine.backends.coreml.backend import CoreMLBackend
from npumoe.engine.loading.load import LoadedModel
from npumoe.engine.plan.expert_plan import ExpertPlan


@torch.inference_mode()
def logits_by_backend(loaded: LoadedModel, plan: ExpertPlan, compiled: Path,
                      ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The model's logits with `plan` run by the coreml backend (graphs under `compiled`) and by torch-static."""
    logits = {}
    for backend in (CoreMLBackend(compiled), TorchStaticBackend()):
        runtime = MoeRuntime(loaded.model, backend, plan)  # one plan on both backends
        try:
            logits[backend.name] = loaded.model(ids).logits
        finally:
            runtime.detach()
    return logits
