"""Fixtures for the Core ML tests: a tiny checkpoint and a plan for it."""

from collections.abc import Callable
from pathlib import Path

import pytest

from npumoe.engine.calibration.calibrate import Calibration
from npumoe.engine.calibration.planner import make_plan
from npumoe.engine.loading.load import load_model
from npumoe.engine.moe.model_experts import moe_experts
from npumoe.engine.plan.expert_plan import ExpertLoad, ExpertPlan


@pytest.fixture
def coreml_plan(tiny_model: Path, tmp_path: Path) -> Callable[..., tuple[Path, ExpertPlan]]:
    """coreml_plan(model_key=None): a saved plan for the tiny model, (path, plan).

    Three tiers by expert, groups of 4; the last group of each layer saw no load in calibration, so
    a compiler leaves it out (the tests know which groups are built without measuring anything).
    """

    def make(model_key: str | None = None) -> tuple[Path, ExpertPlan]:
        loaded = load_model(tiny_model)
        n_experts = loaded.model.config.num_experts
        need = tuple(0.0 if e >= n_experts - 4 else float(8 * (1 + e % 3)) for e in range(n_experts))
        load = ExpertLoad(mean=need, p50=need, p95=need, max=need)
        calibration = Calibration(chunk_tokens=64, tokens=640, chunks=10, sources=("test",),
                                  layers=tuple((name, load) for name, _ in moe_experts(loaded.model)))
        plan = make_plan(calibration, model="tiny", model_key=model_key or loaded.key)
        path = tmp_path / "plan.json"
        plan.save(path)
        return path, plan

    return make
