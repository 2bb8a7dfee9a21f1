"""Fixtures for the Core ML tests: a tiny checkpoint and a `coreml` plan for it."""

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from npumoe.engine.calibrate import Calibration
from npumoe.engine.cost import CostModel
from npumoe.engine.models import load_model, moe_experts
from npumoe.engine.plan import ExpertLoad, ExpertPlan
from npumoe.engine.planner import make_plan

COST = CostModel(launch_s=1e-4, static_flops=1e10, cpu_call_s=1e-5, cpu_flops=1e10)


@pytest.fixture
def coreml_plan(tiny_model: Path, tmp_path: Path) -> Callable[..., tuple[Path, ExpertPlan]]:
    """coreml_plan(model_key=None): a saved coreml plan for the tiny model, (path, plan).

    Three tiers by expert, groups of 4; the first two groups of each layer run on the accelerator,
    the rest on the CPU (residency set here, not by measured costs, so the tests know which).
    """

    def make(model_key: str | None = None) -> tuple[Path, ExpertPlan]:
        loaded = load_model(tiny_model)
        need = tuple(float(8 * (1 + e % 3)) for e in range(loaded.model.config.num_experts))
        load = ExpertLoad(mean=need, p50=need, p95=need, max=need)
        calibration = Calibration(chunk_tokens=64, tokens=640, chunks=10, sources=("test",),
                                  layers=tuple((name, load) for name, _ in moe_experts(loaded.model)))
        plan = make_plan(calibration, model="tiny", model_key=model_key or loaded.key, backend="coreml", cost=COST,
                         hidden=loaded.model.config.hidden_size, ffn=loaded.model.config.moe_intermediate_size)
        plan = dataclasses.replace(plan, layers=tuple(
            dataclasses.replace(layer, groups=tuple(
                dataclasses.replace(group, residency="accelerator" if i < 2 else "cpu")
                for i, group in enumerate(layer.groups)))
            for layer in plan.layers))
        path = tmp_path / "plan.json"
        plan.save(path)
        return path, plan

    return make
