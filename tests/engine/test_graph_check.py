"""The accuracy gate: an accelerator graph is placed only once it has computed what the exact CPU path does."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from npumoe.daemon.cli import main
from npumoe.daemon.cli.engine import plan_group
from npumoe.engine import load_model
from npumoe.engine.backends.base import TorchStaticBackend
from npumoe.engine.backends.placement import place, plan_experts
from npumoe.engine.calibration.planner import calibrate_plan
from npumoe.engine.plan.cost_cache import CostCache
from npumoe.engine.plan.residency import ACCURACY, FORCED, group_key

pytestmark = pytest.mark.usefixtures("home")  # a private NPUMOED_HOME (tests/conftest.py)


class OneWrongOneNonFinite(TorchStaticBackend):
    """torch-static, but the graph of one chosen group returns its input back (wrong) and another's NaN; every
    graph counts the probes it runs (a (G, C, H) call before the runtime exists)."""

    def __init__(self, wrong: torch.Tensor, non_finite: torch.Tensor) -> None:
        self.wrong, self.non_finite = wrong, non_finite
        self.calls: dict[str, int] = {"wrong": 0, "non-finite": 0, "correct": 0}

    def build_group(self, weights, layout, capacity, scale=1.0):
        graph = super().build_group(weights, layout, capacity, scale)
        kind = ("wrong" if torch.equal(weights.down, self.wrong) else
                "non-finite" if torch.equal(weights.down, self.non_finite) else "correct")

        def run(x: torch.Tensor) -> torch.Tensor:
            self.calls[kind] += 1
            if kind == "wrong":
                return x.clone()
            return torch.full_like(x, float("nan")) if kind == "non-finite" else graph(x)

        return run


@pytest.fixture
def placed(tiny, harbour, home, tmp_path):
    """The tiny Qwen3-MoE's plan placed (every group it can build) on a backend whose layer-0 groups 0 and 1 are
    broken, with the costs cached in the home."""
    folder = tiny("qwen3_moe")
    plan = calibrate_plan(folder, [("harbour", harbour)], tmp_path / "plan.json", chunk_tokens=128)
    model = load_model(folder).model
    weights, _ = plan_experts(plan, model)[0]
    groups = plan.layers[0].groups
    backend = OneWrongOneNonFinite(weights.select(groups[0].experts).down, weights.select(groups[1].experts).down)
    residency = place(plan, backend, model, CostCache(home / "costs"), "accelerator")
    return plan, backend, model, residency, CostCache(home / "costs").get("torch-static", plan)


def test_a_graph_that_computes_something_else_is_refused_and_its_group_runs_on_the_cpu(placed):
    plan, backend, _, residency, costs = placed
    wrong, non_finite, correct = residency.layers[0][:3]
    assert (wrong.accelerator, wrong.reason) == (False, ACCURACY)
    assert (non_finite.accelerator, non_finite.reason) == (False, ACCURACY)
    assert costs.refused[group_key(0, 0)].startswith("relative error ")
    assert costs.refused[group_key(0, 1)] == "its outputs on the probe are not finite"
    assert (correct.accelerator, correct.reason) == (True, FORCED)
    assert set(costs.refused) == {group_key(0, 0), group_key(0, 1)}  # every other graph passed its probe
    assert backend.calls["correct"] == sum(len(layer.groups) for layer in plan.layers) - 2  # each probed once


def test_refusals_are_cached_with_the_costs_and_not_probed_again(placed, home):
    plan, backend, model, residency, _ = placed
    backend.calls = dict.fromkeys(backend.calls, 0)
    assert place(plan, backend, model, CostCache(home / "costs"), "accelerator") == residency
    assert sum(backend.calls.values()) == 0


def test_plan_show_and_doctor_say_which_graphs_were_refused_and_why(placed, tmp_path, monkeypatch):
    plan = placed[0]
    monkeypatch.setenv("NPUMOE_MODELS", str(tmp_path / "models"))  # no demo model made: doctor loads none
    shown = CliRunner().invoke(plan_group, ["show", str(tmp_path / "plan.json"), "--backend", "torch-static"],
                               catch_exceptions=False).output
    assert "graphs the accuracy gate refused" in " ".join(shown.split())
    assert f"{plan.layers[0].name} group 1: its outputs on the probe are not finite" in " ".join(shown.split())
    doctor = CliRunner().invoke(main, ["doctor", "--json"], catch_exceptions=False)
    check = {c["check"]: c for c in json.loads(doctor.output)["checks"]}["accelerator graphs"]
    assert check["status"] == "warn" and "torch-static group 0/1: its outputs on the probe are not finite" in \
        check["detail"]
