"""Runtimes on one model: which one runs, and the one packed copy of the weights they share."""

from __future__ import annotations

import logging

import torch

from npumoe.engine.attach.runtime import MoeRuntime
from npumoe.engine.backends.base import TorchStaticBackend
from npumoe.engine.backends.registry import get_backend
from npumoe.engine.calibration.calibrate import Calibration
from npumoe.engine.calibration.planner import make_plan
from npumoe.engine.moe.dispatch import DispatchStats
from npumoe.engine.moe.model_experts import moe_experts
from npumoe.engine.plan.cost import CostModel
from npumoe.engine.plan.expert_plan import ExpertLoad
from npumoe.engine.plan.residency import MeasuredCosts, decide_residency
from npumoe.engine.synthetic.geometry import build_layer_model, draw_routing, parse_geometry, routing_prior

TINY = parse_geometry("64x8x2x32")
GRAPHS_FREE = CostModel(launch_s=1e-9, static_flops=1e15, cpu_call_s=1e-3, cpu_flops=1e9)  # every group in a graph


def tiny_layer():
    generator = torch.Generator().manual_seed(0)
    model = build_layer_model(TINY, torch.float32, generator)
    (_, experts), = moe_experts(model)
    x = torch.randn(16, TINY.hidden, generator=generator)
    index, weights = draw_routing(routing_prior(TINY, generator), 16, TINY.top_k, generator)
    return model, experts, (x, index, weights)


def test_runtimes_of_one_model_share_one_packed_copy_of_its_experts():
    model, _, _ = tiny_layer()
    first, second = MoeRuntime(model, get_backend("cpu")), MoeRuntime(model, get_backend("cpu"))
    assert first.layers[0].experts is second.layers[0].experts


def test_weights_changed_in_place_are_packed_anew():
    model, experts, inputs = tiny_layer()
    first = MoeRuntime(model, get_backend("cpu"))
    with torch.no_grad():
        experts.down_proj.mul_(2)
    second = MoeRuntime(model, get_backend("cpu"))
    assert second.layers[0].experts is not first.layers[0].experts
    model.set_experts_implementation("eager")
    expected = experts(*inputs)
    second.attach()
    torch.testing.assert_close(experts(*inputs), expected, rtol=1e-5, atol=1e-5)


def test_attach_selects_which_runtime_runs_and_detach_gives_back_the_previous_implementation():
    model, experts, inputs = tiny_layer()
    model.set_experts_implementation("grouped_mm")
    before = model.get_experts_implementation()
    first, second = MoeRuntime(model, get_backend("cpu")), MoeRuntime(model, get_backend("cpu"))
    experts(*inputs)  # the runtime built last is attached
    assert (first.stats.layer_calls, second.stats.layer_calls) == (0, 1)
    first.attach()
    experts(*inputs)
    assert (first.stats.layer_calls, second.stats.layer_calls) == (1, 1)
    second.detach()  # not attached: leaves the first one in place
    experts(*inputs)
    assert first.stats.layer_calls == 2
    first.detach()
    assert model.get_experts_implementation() == before


def test_a_counting_block_keeps_its_own_dispatch_counts_and_a_nested_one_leaves_the_outer_blocks_alone():
    model, experts, inputs = tiny_layer()
    runtime = MoeRuntime(model, get_backend("cpu"))
    document, query = DispatchStats(), DispatchStats()
    with runtime.counting(document):
        experts(*inputs)
        with runtime.counting(query):  # as a search query embedded between a document's chunks
            experts(*inputs)
            experts(*inputs)
        experts(*inputs)
    experts(*inputs)
    assert (document.layer_calls, query.layer_calls, runtime.stats.layer_calls) == (2, 2, 1)


def test_experts_a_backend_cannot_run_in_its_graphs_stay_on_the_cpu_and_the_runtime_says_why(caplog):
    model, experts, inputs = tiny_layer()
    (name, _), = moe_experts(model)
    need = tuple(8.0 for _ in range(TINY.experts))
    calibration = Calibration(chunk_tokens=64, tokens=640, chunks=10, sources=("test",),
                              layers=((name, ExpertLoad(mean=need, p50=need, p95=need, max=need)),))
    plan = make_plan(calibration, model="tiny", model_key="tiny@1")
    residency = decide_residency(plan, TorchStaticBackend, MeasuredCosts(GRAPHS_FREE, TINY.hidden, TINY.ffn, "test"))
    assert MoeRuntime(model, TorchStaticBackend(), plan, residency=residency).layers[0].groups  # groups in graphs

    class NoGraphsForThisLayout(TorchStaticBackend):
        def static_problem(self, layout):
            return f"{layout.activation} is not converted"

    with caplog.at_level(logging.WARNING):
        runtime = MoeRuntime(model, NoGraphsForThisLayout(), plan, residency=residency)
    assert runtime.layers[0].groups == []
    assert f"{name}: its experts run on the CPU, not in torch-static group graphs: silu is not converted" in [
        record.getMessage() for record in caplog.records]
    model.set_experts_implementation("eager")
    expected = experts(*inputs)
    runtime.attach()
    torch.testing.assert_close(experts(*inputs), expected, rtol=1e-5, atol=1e-5)
