"""The fp16 range guard, on a tiny model whose experts produce values beyond fp16's 65,504."""

import numpy as np
import pytest
import torch

from npumoe.engine.backends.coreml.backend import CoreMLGroupGraph
from npumoe.engine.backends.coreml.cache import INPUT_NAME, OUTPUT_NAME
from npumoe.engine.backends.coreml.convert import plan_group_graphs, scaled_weights
from npumoe.engine.backends.registry import backend_class
from npumoe.engine.calibration.calibrate import calibrate
from npumoe.engine.calibration.planner import make_plan
from npumoe.engine.loading.load import load_model
from npumoe.engine.moe.experts_layout import DEFAULT_LAYOUT, ExpertWeights
from npumoe.engine.moe.grouped import GroupedExperts
from npumoe.engine.moe.model_experts import moe_experts
from npumoe.engine.plan.residency import FP16_MAX, FP16_RANGE, decide_residency


@pytest.fixture(scope="module")
def loud_model(tiny, harbour):
    """(the tiny Qwen3-MoE's first experts module, a plan calibrated on it, loud, gated): expert `loud`'s up and
    down projections and expert `gated`'s gate rows are blown up, their weights still inside fp16. They are its
    busiest and its least busy routed expert (the first layer's routing does not depend on its experts' weights,
    so a first calibration finds them)."""
    loaded = load_model(tiny("qwen3_moe"))
    name, experts = moe_experts(loaded.model)[0]
    load = dict(calibrate(loaded, [("harbour", harbour)], chunk_tokens=128).layers)[name].mean
    busy = sorted((e for e in range(len(load)) if load[e]), key=lambda e: load[e])
    loud, gated = busy[-1], busy[0]
    inter = experts.down_proj.shape[2]
    with torch.no_grad():
        experts.gate_up_proj[loud, inter:] *= 300
        experts.down_proj[loud] *= 300
        experts.gate_up_proj[gated, :inter] *= 1e5
    plan = make_plan(calibrate(loaded, [("harbour", harbour)], chunk_tokens=128), model=loaded.name,
                     model_key=loaded.key)
    assert group_of(plan, loud) != group_of(plan, gated)
    return experts, plan, loud, gated


def group_of(plan, expert: int) -> int:
    return next(g for g, group in enumerate(plan.layers[0].groups) if expert in group.experts)


def test_calibration_records_values_beyond_fp16(loud_model):
    _, plan, loud, gated = loud_model
    peaks = plan.layers[0].magnitudes
    assert peaks.output[loud] > FP16_MAX and peaks.gate[gated] > FP16_MAX
    quiet = [e for e in range(len(peaks.output)) if e not in (loud, gated) and plan.layers[0].load.mean[e]]
    assert max(peaks.output[e] for e in quiet) < FP16_MAX


def test_the_neural_engine_scales_the_loud_group_and_keeps_the_gate_overflow_on_the_cpu(loud_model):
    _, plan, loud, gated = loud_model
    placed = decide_residency(plan, backend_class("coreml"))
    scaled, kept = placed.layers[0][group_of(plan, loud)], placed.layers[0][group_of(plan, gated)]
    assert scaled.accelerator and scaled.scale >= plan.layers[0].magnitudes.output[loud] / FP16_MAX
    assert (kept.accelerator, kept.reason) == (False, FP16_RANGE)
    graphs = plan_group_graphs(plan, placed)  # what compile converts: the loud group scaled, the gated one left out
    assert [g.scale for g in graphs if g.layer == 0 and loud in g.experts] == [scaled.scale]
    assert not any(g.layer == 0 and gated in g.experts for g in graphs)
    torch_static = decide_residency(plan, backend_class("torch-static"))  # fp32 or bf16: no guard needed
    assert torch_static.layers[0][group_of(plan, gated)].accelerator
    assert {p.scale for p in torch_static.placements()} == {1.0}


class Fp16Graph:
    """Stands in for a converted Core ML function: the same group graph (ANE layout) computed in fp16."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, scale: float) -> None:
        weights = scaled_weights(ExpertWeights(gate_up, down), DEFAULT_LAYOUT, scale)
        self.graph = GroupedExperts(weights, layout="ane").half()
        self.calls = 0

    def predict(self, inputs: dict) -> dict:
        self.calls += 1
        with torch.no_grad():
            # Core ML rounds the float32 it is handed to the function's fp16 input
            return {OUTPUT_NAME: self.graph(torch.from_numpy(inputs[INPUT_NAME]).half()).numpy().astype(np.float16)}


def test_a_scaled_fp16_graph_computes_the_loud_group_that_overflows_unscaled(loud_model):
    experts, plan, loud, _ = loud_model
    placement = decide_residency(plan, backend_class("coreml")).layers[0][group_of(plan, loud)]
    ids = list(plan.layers[0].groups[group_of(plan, loud)].experts)
    gate_up, down = experts.gate_up_proj[ids].detach(), experts.down_proj[ids].detach()
    x = torch.randn(len(ids), placement.capacity, gate_up.shape[2], generator=torch.Generator().manual_seed(0))
    want = GroupedExperts(ExpertWeights(gate_up, down))(x)
    assert want.abs().max() > FP16_MAX
    for scale, finite in ((1.0, False), (placement.scale, True)):
        stand_in = Fp16Graph(gate_up, down, scale)
        got = CoreMLGroupGraph(lambda stand_in=stand_in: stand_in, len(ids), scale)(x)
        assert stand_in.calls == 1
        assert bool(torch.isfinite(got).all()) == finite
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
