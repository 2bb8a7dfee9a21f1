"""Residency: where a plan's groups run is decided per backend and machine, from measured costs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from npumoe.engine import Engine, EngineSettings, load_model
from npumoe.engine.backends.base import TorchStaticBackend
from npumoe.engine.backends.placement import place
from npumoe.engine.backends.registry import backend_class
from npumoe.engine.calibration.calibrate import Calibration
from npumoe.engine.calibration.planner import calibrate_plan, make_plan
from npumoe.engine.plan import residency
from npumoe.engine.plan.cost import CostModel
from npumoe.engine.plan.cost_cache import CostCache
from npumoe.engine.plan.expert_plan import ExpertLoad, ExpertMagnitudes
from npumoe.engine.plan.residency import (
    CHEAPER,
    FORCED,
    FP16_LIMIT,
    FP16_RANGE,
    IDLE,
    MEMORY,
    NO_GRAPHS,
    PLACEMENT,
    GroupMeasure,
    MeasuredCosts,
    aligned_capacity,
    decide_residency,
    group_key,
    padding_cost,
)

ACCELERATOR_FAVOURED = CostModel(launch_s=1e-9, static_flops=1e15, cpu_call_s=1e-3, cpu_flops=1e9)
CPU_FAVOURED = CostModel(launch_s=1.0, static_flops=1e9, cpu_call_s=1e-9, cpu_flops=1e15)
TORCH_STATIC, COREML, CPU = (backend_class(name) for name in ("torch-static", "coreml", "cpu"))
CPU_BETTER_EVERYWHERE = CostModel(launch_s=10.0, static_flops=1.0, cpu_call_s=1e-12, cpu_flops=1e18)


def measured(cost: CostModel, groups: dict[str, GroupMeasure] | None = None) -> MeasuredCosts:
    return MeasuredCosts(cost=cost, hidden=64, ffn=32, measured_on="test", groups=groups or {})


def synthetic_plan(magnitudes: ExpertMagnitudes | None = None):
    """Two layers of 6 experts over 64-token chunks: hot, warm, cold and idle experts (expert 4 of layer 0 idle)."""
    def load(p95: list[float]) -> ExpertLoad:
        mean = tuple(v * 0.8 for v in p95)
        return ExpertLoad(mean=mean, p50=mean, p95=tuple(p95), max=tuple(v * 1.1 for v in p95))

    layers = (("layers.0.experts", load([60, 30, 9, 3, 0, 1])), ("layers.1.experts", load([2, 0, 58, 33, 12, 7])))
    calibration = Calibration(chunk_tokens=64, tokens=640, chunks=10, sources=("synthetic",), layers=layers,
                              magnitudes=tuple((name, magnitudes) for name, _ in layers) if magnitudes else ())
    return make_plan(calibration, model="synthetic", model_key="synthetic@0", group_size=2)


def test_residency_differs_where_the_measured_costs_differ():
    plan = synthetic_plan()
    cheap_launches = decide_residency(plan, TORCH_STATIC, measured(ACCELERATOR_FAVOURED))
    costly_launches = decide_residency(plan, TORCH_STATIC, measured(CPU_FAVOURED))
    for layer, placements in zip(plan.layers, cheap_launches.layers, strict=True):
        for group, placement in zip(layer.groups, placements, strict=True):
            busy = any(layer.load.mean[e] > 0 for e in group.experts)
            assert placement.accelerator == busy
            assert placement.reason == (CHEAPER if busy else IDLE)
    assert costly_launches.accelerator_groups == 0 and costly_launches.cpu_groups == cheap_launches.cpu_groups + \
        cheap_launches.accelerator_groups
    assert cheap_launches.measured_on == "test"


def test_a_graph_timed_on_the_device_overrides_the_cost_model():
    plan = synthetic_plan()
    modelled = decide_residency(plan, TORCH_STATIC, measured(ACCELERATOR_FAVOURED))
    assert modelled.layers[0][0].accelerator
    slow = measured(ACCELERATOR_FAVOURED, {group_key(0, 0): GroupMeasure(10.0)})
    slow_graph = decide_residency(plan, TORCH_STATIC, slow)
    assert not slow_graph.layers[0][0].accelerator and slow_graph.layers[0][0].reason == CHEAPER
    assert slow_graph.layers[1] == modelled.layers[1]


def test_a_group_whose_ops_mostly_fall_off_the_neural_engine_stays_on_the_cpu():
    plan = synthetic_plan()
    busy = [g for g, group in enumerate(plan.layers[0].groups) if any(plan.layers[0].load.mean[e]
                                                                         for e in group.experts)]
    costs = measured(ACCELERATOR_FAVOURED, {group_key(0, busy[0]): GroupMeasure(1e-6, device_ops=2, ops=10),
                                            group_key(0, busy[1]): GroupMeasure(1e-6, device_ops=9, ops=10)})
    placed = decide_residency(plan, COREML, costs)
    assert (placed.layers[0][busy[0]].accelerator, placed.layers[0][busy[0]].reason) == (False, PLACEMENT)
    assert placed.layers[0][busy[1]].accelerator  # one op off the Neural Engine in ten: still resident


def test_the_cpu_backend_runs_every_group_on_the_cpu():
    placed = decide_residency(synthetic_plan(), CPU, measured(ACCELERATOR_FAVOURED))
    assert placed.accelerator_groups == 0 and {p.reason for p in placed.placements()} == {NO_GRAPHS}


def test_capacities_are_aligned_to_the_backends_multiple_and_the_padding_is_counted():
    plan = synthetic_plan()
    assert plan.tiers == (8, 16, 40, 64)
    assert TORCH_STATIC.capacity_multiple == 1 and COREML.capacity_multiple == 32  # 64 bytes of fp16
    coreml = decide_residency(plan, COREML)
    torch_static = decide_residency(plan, TORCH_STATIC)
    for layer, on_coreml, on_torch in zip(plan.layers, coreml.layers, torch_static.layers, strict=True):
        for group, a, b in zip(layer.groups, on_coreml, on_torch, strict=True):
            assert b.capacity == plan.tiers[group.tier]
            assert a.capacity == {8: 32, 16: 32, 40: 64, 64: 64}[b.capacity]
    assert aligned_capacity(40, 32, 48) == 48  # never past the chunk
    plain, aligned = padding_cost(plan, 32)
    assert plain == sum(len(g.experts) * plan.tiers[g.tier] for layer in plan.layers for g in layer.groups)
    assert aligned == sum(len(g.experts) * p.capacity for layer, ps in zip(plan.layers, coreml.layers, strict=True)
                          for g, p in zip(layer.groups, ps, strict=True))
    assert aligned > plain


def test_fp16_backends_scale_groups_beyond_fp16_and_keep_a_gate_overflow_on_the_cpu():
    small = [1.0] * 6
    big_output = ExpertMagnitudes(activation=tuple(small), gate=tuple(small),
                                  output=(3 * FP16_LIMIT, *small[1:]))
    big_gate = ExpertMagnitudes(activation=tuple(small), gate=(2 * FP16_LIMIT, *small[1:]), output=tuple(small))
    scaled = decide_residency(synthetic_plan(big_output), COREML)
    group = next(g for g, grp in enumerate(synthetic_plan().layers[0].groups) if 0 in grp.experts)
    assert scaled.layers[0][group].accelerator and scaled.layers[0][group].scale == 4.0
    assert {p.scale for g, p in enumerate(scaled.layers[0]) if g != group} == {1.0}
    kept = decide_residency(synthetic_plan(big_gate), COREML)
    assert (kept.layers[0][group].accelerator, kept.layers[0][group].reason) == (False, FP16_RANGE)
    assert decide_residency(synthetic_plan(big_gate), TORCH_STATIC).layers[0][group].scale == 1.0  # not fp16


class CountingBackend(TorchStaticBackend):
    measured = 0

    def measure_costs(self, *args, **kwargs) -> CostModel:
        CountingBackend.measured += 1
        return super().measure_costs(*args, **kwargs)


def test_costs_are_measured_once_per_backend_machine_and_plan_then_read_from_the_cache(tiny, harbour, tmp_path):
    folder = tiny("qwen3_moe")
    plan = calibrate_plan(folder, [("harbour", harbour)], tmp_path / "plan.json", chunk_tokens=128)
    model = load_model(folder).model
    cache = CostCache(tmp_path / "costs")
    CountingBackend.measured = 0
    first = place(plan, CountingBackend(), model, cache)
    again = place(plan, CountingBackend(), model, cache)
    assert CountingBackend.measured == 1 and first == again
    assert cache.path("torch-static", plan).is_file()
    assert place(plan, CountingBackend(), model, None) is not None and CountingBackend.measured == 2


@pytest.mark.parametrize("backend", ["cpu", "coreml"])
def test_a_plan_runs_on_any_backend_with_the_outputs_of_torch_static(tiny, harbour, orchard, tmp_path, backend,
                                                                     monkeypatch):
    """One plan, no backend in it: cpu and coreml (through torch off macOS) compute what torch-static does."""
    # Every measured group a graph: on a busy machine the timing may find none cheaper than the CPU path, and then
    # torch-static would compare the CPU path with itself.
    monkeypatch.setattr(residency, "_graph_seconds", lambda *_: 0.0)
    monkeypatch.setattr(residency, "_host_seconds", lambda *_: 0.0)
    folder = tiny("qwen3_moe")
    calibrate_plan(folder, [("harbour", harbour)], tmp_path / "plan.json", chunk_tokens=128)
    ids = None
    logits = {}
    for name in ("torch-static", backend):
        engine = Engine.load(EngineSettings(model=str(folder), backend=name, plan=tmp_path / "plan.json",
                                            compiled_dir=tmp_path / "compiled", costs_dir=tmp_path / "costs",
                                            weights="fp32"))
        ids = ids or engine.loaded.tokenizer(orchard)["input_ids"][:256]
        logits[name] = engine.logits(ids)
        if name != "cpu":
            assert engine.stats.static > 0  # the plan's groups ran as static graphs
        engine.close()
    torch.testing.assert_close(logits[backend], logits["torch-static"], rtol=1e-4, atol=1e-4)
    cached = sorted(path.name.rpartition("-")[0].rpartition("-")[0] for path in (tmp_path / "costs").iterdir())
    assert cached == (["torch-static"] if backend == "cpu" else ["coreml", "torch-static"])


def test_the_accelerator_policy_places_every_group_whatever_the_costs_say():
    plan = synthetic_plan()
    measured_policy = decide_residency(plan, TORCH_STATIC, measured(CPU_FAVOURED))
    forced = decide_residency(plan, TORCH_STATIC, measured(CPU_FAVOURED), policy="accelerator")
    assert measured_policy.accelerator_groups == 0
    assert forced.cpu_groups == 0 and {p.reason for p in forced.placements()} == {FORCED}  # the idle group too
    assert decide_residency(plan, CPU, measured(CPU_FAVOURED), policy="accelerator").accelerator_groups == 0


def test_the_accelerator_policy_still_keeps_a_group_out_of_fp16_range_on_the_cpu():
    big_gate = ExpertMagnitudes(gate=(FP16_LIMIT * 2,) * 6, activation=(1.0,) * 6, output=(1.0,) * 6)
    placed = decide_residency(synthetic_plan(big_gate), COREML, measured(CPU_FAVOURED), policy="accelerator")
    assert placed.accelerator_groups == 0 and {p.reason for p in placed.placements()} == {FP16_RANGE}


def test_forced_placement_runs_the_planned_path_end_to_end_with_the_cpu_paths_outputs(tiny, harbour, orchard,
                                                                                      tmp_path):
    """On a machine where every graph costs more than the CPU path (the cached costs say so), the accelerator policy
    still runs the plan's groups as graphs, and spill keeps the outputs those of the exact CPU path."""
    folder = tiny("qwen3_moe")
    plan = calibrate_plan(folder, [("harbour", harbour)], tmp_path / "plan.json", chunk_tokens=128)
    CostCache(tmp_path / "costs").put("torch-static", plan, MeasuredCosts(CPU_BETTER_EVERYWHERE, 64, 32, "test"))
    logits, static = {}, {}
    for policy in ("measured", "accelerator"):
        engine = Engine.load(EngineSettings(model=str(folder), backend="torch-static", plan=tmp_path / "plan.json",
                                            costs_dir=tmp_path / "costs", weights="fp32", residency=policy))
        ids = engine.loaded.tokenizer(orchard)["input_ids"][:256]
        logits[policy], static[policy] = engine.logits(ids), engine.stats.static
        engine.close()
    assert static == {"measured": 0, "accelerator": static["accelerator"]} and static["accelerator"] > 0
    torch.testing.assert_close(logits["accelerator"], logits["measured"], rtol=1e-4, atol=1e-4)


def test_an_unknown_residency_policy_is_refused():
    with pytest.raises(ValueError, match="residency must be one of measured, accelerator"):
        EngineSettings(model="m", residency="always")


def test_the_hosts_packing_and_unpacking_count_in_a_graphs_cost():
    plan = synthetic_plan()
    slow_host = CostModel(**{**vars(ACCELERATOR_FAVOURED), "host_row_s": 1.0})  # a second a buffer row
    assert decide_residency(plan, TORCH_STATIC, measured(ACCELERATOR_FAVOURED)).accelerator_groups > 0
    assert decide_residency(plan, TORCH_STATIC, measured(slow_host)).accelerator_groups == 0


def even_plan(*busy: float):
    """One layer per value: 8 experts in 4 groups of 2, every expert that busy, at one tier (no spill)."""
    layers = tuple((f"layers.{i}.experts", ExpertLoad(mean=(load,) * 8, p50=(load,) * 8, p95=(load,) * 8,
                                                       max=(load,) * 8)) for i, load in enumerate(busy))
    calibration = Calibration(chunk_tokens=64, tokens=640, chunks=10, sources=("synthetic",), layers=layers)
    return make_plan(calibration, model="synthetic", model_key="synthetic@0", group_size=2, n_tiers=1)


def cpu_cost(plan, layer: int, group: int) -> float:
    load = plan.layers[layer].load.mean
    return ACCELERATOR_FAVOURED.cpu_seconds([load[e] for e in plan.layers[layer].groups[group].experts], 64, 32)


def test_a_group_cheaper_alone_on_the_accelerator_stays_on_the_cpu_when_the_accelerator_is_the_bottleneck():
    """Each graph takes 0.8 of its experts' CPU time: alone, every group is cheaper as a graph; but the accelerator
    runs them one after another beside the CPU, so the layer is shortest with two there (max(1.6, 2.0) = 2.0 of one
    group's CPU time) rather than four (3.2), and the other two stay on the CPU."""
    plan = even_plan(20.0)
    cpu_s = cpu_cost(plan, 0, 0)
    costs = measured(ACCELERATOR_FAVOURED, {group_key(0, g): GroupMeasure(0.8 * cpu_s) for g in range(4)})
    placed = decide_residency(plan, TORCH_STATIC, costs)
    assert [p.accelerator for p in placed.layers[0]].count(True) == 2
    assert {p.reason for p in placed.placements()} == {CHEAPER}
    assert residency.expected_seconds(plan, placed, costs) == pytest.approx(2 * cpu_s)
    alone = measured(ACCELERATOR_FAVOURED, {group_key(0, 0): GroupMeasure(0.8 * cpu_s)})  # the others cost ~nothing
    assert decide_residency(plan, TORCH_STATIC, alone).accelerator_groups == 4  # nothing to wait for: all four


def test_makespan_placement_keeps_within_the_device_memory_budget_taking_the_biggest_gains_first():
    """Room for 4 experts (2 groups) over two layers: both go to the busier layer, where a move saves more; the
    groups that would still shorten a layer stay on the CPU for memory."""
    plan = even_plan(40.0, 10.0)
    cheap = measured(ACCELERATOR_FAVOURED)
    roomy = decide_residency(plan, TORCH_STATIC, cheap)
    assert roomy.accelerator_groups == 8
    tight = decide_residency(plan, TORCH_STATIC, replace(cheap, device_experts=4))
    on_device = [[p.accelerator for p in layer] for layer in tight.layers]
    assert [row.count(True) for row in on_device] == [2, 0]
    assert sum(len(group.experts) for layer, row in zip(plan.layers, on_device, strict=True)
               for group, there in zip(layer.groups, row, strict=True) if there) <= 4
    assert {p.reason for p in tight.placements() if not p.accelerator} == {MEMORY}


def test_a_graph_timed_on_the_device_still_pays_the_hosts_packing_of_its_filled_rows():
    plan = synthetic_plan()
    timed = {group_key(i, g): GroupMeasure(1e-9) for i, layer in enumerate(plan.layers)
             for g in range(len(layer.groups))}
    assert decide_residency(plan, TORCH_STATIC, measured(ACCELERATOR_FAVOURED, timed)).accelerator_groups > 0
    slow_host = CostModel(**{**vars(ACCELERATOR_FAVOURED), "host_row_s": 1.0})
    assert decide_residency(plan, TORCH_STATIC, measured(slow_host, timed)).accelerator_groups == 0


def test_the_hosts_packing_runs_before_and_after_both_sides_so_it_overlaps_neither():
    """Free graphs whose packing costs the host 0.6 of a group's CPU time: the host packs before the launches and the
    CPU experts start, and unpacks after both, so each group moved costs 0.6 and saves 1: all four go (2.4), where
    counting the packing on the accelerator's side alone would stop at three (max(1.8, 1.0))."""
    plan = even_plan(20.0)
    cpu_s = cpu_cost(plan, 0, 0)
    filled = sum(min(plan.layers[0].load.mean[e], plan.tiers[plan.layers[0].groups[0].tier])
                 for e in plan.layers[0].groups[0].experts)
    packing = CostModel(**{**vars(ACCELERATOR_FAVOURED), "host_row_s": 0.6 * cpu_s / filled})
    costs = measured(packing, {group_key(0, g): GroupMeasure(0.0) for g in range(4)})
    placed = decide_residency(plan, TORCH_STATIC, costs)
    assert placed.accelerator_groups == 4
    assert residency.expected_seconds(plan, placed, costs) == pytest.approx(2.4 * cpu_s)
    assert residency.layer_seconds(plan, costs, 0, placed.layers[0]).host == pytest.approx(2.4 * cpu_s)


def test_the_hosts_cost_per_row_is_timed_on_dispatchs_own_packing_and_unpacking(monkeypatch):
    from npumoe.engine.backends import base
    from npumoe.engine.moe.dispatch import MoeLayer

    calls = {"pack": 0, "unpack": 0}
    for name in calls:
        real = getattr(MoeLayer, name)

        def counted(self, *args, name=name, real=real):
            calls[name] += 1
            return real(self, *args)

        monkeypatch.setattr(MoeLayer, name, counted)
    seconds = base.host_row_seconds(64, torch.bfloat16, 4, rows=256, repeats=2)
    assert seconds > 0 and calls["pack"] == calls["unpack"] >= 3  # a warm-up and each timed round
