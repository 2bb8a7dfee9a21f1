"""The fidelity benchmark: capacity against accuracy, on a calibrated tiny skewed model and held-out text."""

from __future__ import annotations

import pytest
import torch

from npumoe.bench.fidelity.capacity import FidelitySettings, agreement, run_fidelity_bench, scaled
from npumoe.bench.fidelity.plot import fidelity_figure
from npumoe.engine.calibration.calibrate import Calibration
from npumoe.engine.loading.load import load_model
from npumoe.engine.plan.expert_plan import ExpertLoad


@pytest.fixture(scope="module")
def sweep(tiny, harbour, orchard) -> list[dict]:
    settings = FidelitySettings(threads=1, scales=(0.25, 8.0), chunk_tokens=64, eval_tokens=256, warmup=0,
                                repeats=1)
    return run_fidelity_bench(load_model(tiny("qwen3_moe")), [("harbour", harbour)], orchard, settings)


def _row(rows, scale, overflow):
    return next(r for r in rows if r.get("capacity_scale") == scale and r.get("overflow") == overflow)


def test_the_sweep_reports_the_exact_model_then_each_scale_and_policy(sweep):
    assert sweep[0]["impl"] == "exact" and sweep[0]["eval_tokens"] == 256
    assert [(r["capacity_scale"], r["overflow"]) for r in sweep[1:]] == [
        (0.25, "prune"), (0.25, "spill"), (8.0, "prune"), (8.0, "spill")]
    assert all(r["tokens_per_s"] > 0 for r in sweep)


def test_small_capacity_drops_assignments_and_costs_agreement(sweep):
    small = _row(sweep, 0.25, "prune")
    assert small["dropped_fraction"] > 0.05
    assert small["top1_agreement"] < 1.0 and small["mean_kl"] > 0


def test_ample_capacity_drops_nothing_and_matches_the_exact_model(sweep):
    ample = _row(sweep, 8.0, "prune")
    assert ample["dropped_fraction"] == 0 and ample["top1_agreement"] == 1.0
    assert ample["mean_kl"] < 1e-9
    assert ample["padding_fraction"] > _row(sweep, 0.25, "prune")["padding_fraction"]


def test_spilling_keeps_the_exact_answer_at_any_capacity(sweep):
    spill = _row(sweep, 0.25, "spill")
    assert spill["spilled_fraction"] > 0.05 and spill["dropped_fraction"] == 0
    assert spill["top1_agreement"] == 1.0 and spill["mean_kl"] < 1e-9


def test_the_plot_has_three_panels_and_saves_as_png(sweep, tmp_path):
    figure = fidelity_figure(sweep)
    assert [axis.get_title() for axis in figure.axes[:3]] == ["Assignments", "Accuracy under prune",
                                                            "Accuracy vs latency"]
    figure.savefig(tmp_path / "fidelity.png")
    assert (tmp_path / "fidelity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_agreement_is_perfect_for_identical_logits_and_counts_changed_argmaxes():
    exact = torch.tensor([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
    assert agreement(exact, exact) == {"top1_agreement": 1.0, "mean_kl": 0.0}
    swapped = torch.tensor([[0.0, 2.0, 0.0], [0.0, 2.0, 0.0]])
    result = agreement(swapped, exact)
    assert result["top1_agreement"] == 0.5 and result["mean_kl"] > 0


def test_scaling_a_calibration_scales_only_the_p95_load_the_planner_sizes_for():
    load = ExpertLoad(mean=(1.0, 2.0), p50=(1.0, 2.0), p95=(4.0, 8.0), max=(5.0, 9.0))
    calibration = Calibration(chunk_tokens=8, tokens=16, chunks=2, sources=("s",), layers=(("layer", load),))
    (_, half), = scaled(calibration, 0.5).layers
    assert half == ExpertLoad(mean=(1.0, 2.0), p50=(1.0, 2.0), p95=(2.0, 4.0), max=(5.0, 9.0))


def test_bad_scales_are_refused():
    with pytest.raises(ValueError, match="scales"):
        FidelitySettings(threads=1, scales=(0.0, 1.0))
