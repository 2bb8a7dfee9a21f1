"""ExpertPlan: tiers from calibrated loads, groups, JSON validation, old files, and prune's drops."""

from __future__ import annotations

import itertools
import json
import random
from contextlib import contextmanager
from dataclasses import replace

import pytest

from npumoe.engine import Engine, EngineSettings, load_model
from npumoe.engine.attach.runtime import MoeRuntime
from npumoe.engine.backends.registry import get_backend
from npumoe.engine.calibration.calibrate import Calibration, calibrate
from npumoe.engine.calibration.planner import calibrate_plan, choose_tiers, make_plan
from npumoe.engine.plan.cost import CostModel
from npumoe.engine.plan.cost_cache import CostCache
from npumoe.engine.plan.expert_plan import PLAN_VERSION, ExpertLoad, ExpertPlan, PlanError
from npumoe.engine.plan.residency import MeasuredCosts


def synthetic_calibration() -> Calibration:
    """Two layers of 6 experts over 64-token chunks: hot, warm, cold and idle experts."""
    def load(p95: list[float]) -> ExpertLoad:
        mean = tuple(v * 0.8 for v in p95)
        return ExpertLoad(mean=mean, p50=mean, p95=tuple(p95), max=tuple(v * 1.1 for v in p95))

    return Calibration(chunk_tokens=64, tokens=640, chunks=10, sources=("synthetic",), layers=(
        ("layers.0.experts", load([60, 30, 9, 3, 0, 1])),
        ("layers.1.experts", load([2, 0, 58, 33, 12, 7])),
    ))


def plan_for(**options) -> ExpertPlan:
    return make_plan(synthetic_calibration(), model="synthetic", model_key="synthetic@0", **options)


def brute_force_tiers(needs: list[int], n_tiers: int) -> int:
    values = sorted(set(needs))
    candidates = (tiers for k in range(1, n_tiers + 1) for tiers in itertools.combinations(values, k)
                  if max(tiers) == values[-1])
    return min(sum(min(c for c in tiers if c >= n) for n in needs) for tiers in candidates)


def test_tiers_minimise_the_total_capacity_handed_out():
    rng = random.Random(0)
    for _ in range(50):
        needs = [rng.choice(range(8, 129, 8)) for _ in range(rng.randint(1, 12))]
        n_tiers = rng.randint(1, 4)
        tiers = choose_tiers(needs, n_tiers)
        assert len(tiers) <= n_tiers and max(tiers) == max(needs)
        assert sum(min(c for c in tiers if c >= n) for n in needs) == brute_force_tiers(needs, n_tiers)


def test_each_expert_gets_the_smallest_tier_covering_its_aligned_p95_load():
    plan = plan_for(n_tiers=3)
    # Aligned needs 8 x4, 16 x2, 32, 40, 64 x2: (16, 40, 64) hands out 304 slots, (8, 16, 64) 320.
    assert plan.tiers == (16, 40, 64)
    for layer, (_, load) in zip(plan.layers, synthetic_calibration().layers, strict=True):
        for e, p95 in enumerate(load.p95):
            capacity = plan.tiers[layer.expert_tier[e]]
            assert capacity >= p95
            assert layer.expert_tier[e] == 0 or plan.tiers[layer.expert_tier[e] - 1] < -(-p95 // 8) * 8


def test_groups_hold_up_to_g_experts_of_one_tier_hottest_first():
    plan = plan_for(group_size=2)
    for layer in plan.layers:
        assert sorted(e for g in layer.groups for e in g.experts) == list(range(6))
        for group in layer.groups:
            assert 1 <= len(group.experts) <= 2
            assert {layer.expert_tier[e] for e in group.experts} == {group.tier}
            loads = [layer.load.mean[e] for e in group.experts]
            assert loads == sorted(loads, reverse=True)


def test_a_plan_survives_save_and_load_unchanged(tmp_path):
    plan = plan_for()
    plan.save(tmp_path / "plan.json")
    assert ExpertPlan.load(tmp_path / "plan.json") == plan
    assert json.loads((tmp_path / "plan.json").read_text())["format"] == "npumoe.expert-plan"


def mutated(change) -> dict:
    data = json.loads(json.dumps(plan_for().to_dict()))
    change(data)
    return data


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d.update(version=99), "plan version 99 is not supported"),
    (lambda d: d.pop("model_key"), "model_key: missing"),
    (lambda d: d.update(format="other"), "not an expert plan"),
    (lambda d: d.update(tiers=[16, 8, 64]), "tiers: must be strictly increasing"),
    (lambda d: d.update(chunk_tokens=0), "chunk_tokens: must be positive"),
    (lambda d: d["layers"][0].update(magnitudes={"activation": [1.0], "gate": [], "output": []}),
     r"layers\[0\].magnitudes.activation: must hold 6"),
    (lambda d: d["layers"][1]["expert_tier"].__setitem__(0, 7), r"layers\[1\].expert_tier: must list"),
    (lambda d: d["layers"][0]["load"]["p95"].pop(), r"layers\[0\].load.p95: must hold 6"),
    (lambda d: d["layers"][0]["groups"].pop(), r"layers\[0\].groups: experts \[.*\] are in no group"),
    (lambda d: d["layers"][0]["groups"][1]["experts"].append(d["layers"][0]["groups"][0]["experts"][0]),
     "is already in another group"),
    (lambda d: d["layers"][1].update(name=d["layers"][0]["name"]), "two layers have the same name"),
])
def test_an_inconsistent_plan_is_refused_naming_the_field(tmp_path, change, message):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(mutated(change)))
    with pytest.raises(PlanError, match=message):
        ExpertPlan.load(path)


def test_a_plan_file_that_is_not_json_is_refused(tmp_path):
    (tmp_path / "plan.json").write_text("{not json")
    with pytest.raises(PlanError, match="cannot read plan"):
        ExpertPlan.load(tmp_path / "plan.json")


@pytest.fixture(scope="module")
def qwen3_plan(tiny, harbour, tmp_path_factory) -> tuple[str, ExpertPlan]:
    """The skewed tiny Qwen3-MoE calibrated on one text with the default chunk and tiers."""
    folder = tiny("qwen3_moe")
    loaded = load_model(folder)
    plan = make_plan(calibrate(loaded, [("harbour", harbour)]), model=loaded.name, model_key=loaded.key)
    return str(folder), plan


def test_prune_with_default_tiers_drops_at_most_a_tenth_of_assignments_on_another_text(
        qwen3_plan, orchard, tmp_path):
    folder, plan = qwen3_plan
    plan.save(tmp_path / "plan.json")
    # costs under which every group calibration saw load for pays on the accelerator
    cheap_launches = CostModel(launch_s=1e-9, static_flops=1e15, cpu_call_s=1e-3, cpu_flops=1e9)
    CostCache(tmp_path / "costs").put("torch-static", plan, MeasuredCosts(cheap_launches, 64, 32, "test"))
    engine = Engine.load(EngineSettings(model=folder, backend="torch-static", plan=tmp_path / "plan.json",
                                        overflow="prune", costs_dir=tmp_path / "costs"))
    engine.logits(engine.loaded.tokenizer(orchard)["input_ids"])
    stats = engine.stats
    assert stats.static > 0.9 * stats.assignments  # the accelerator did the work: drops were possible
    assert 0 <= stats.dropped <= 0.10 * stats.assignments
    assert stats.spilled == 0


def test_the_plan_chunk_length_overrides_the_settings(qwen3_plan, tmp_path):
    folder, plan = qwen3_plan
    replace(plan, chunk_tokens=96).save(tmp_path / "plan.json")
    engine = Engine.load(EngineSettings(model=folder, backend="torch-static", plan=tmp_path / "plan.json",
                                        chunk_tokens=512))
    assert engine.chunk_tokens == 96


def test_a_version_1_plan_file_still_loads_without_its_backend_costs_and_residency(qwen3_plan, tmp_path):
    """A plan file as the engine wrote it before plans were backend-free: its backend, costs and residency go."""
    folder, plan = qwen3_plan
    old = plan.to_dict()
    old.update(version=1, backend="torch-static", overflow="prune",
               cost={"launch_s": 1e-5, "static_flops": 1e10, "cpu_call_s": 1e-6, "cpu_flops": 1e10})
    for layer in old["layers"]:
        del layer["magnitudes"]
        for g, group in enumerate(layer["groups"]):
            group["residency"] = "accelerator" if g % 2 else "cpu"
    (tmp_path / "old.json").write_text(json.dumps(old))
    loaded = ExpertPlan.load(tmp_path / "old.json")
    assert loaded.version == PLAN_VERSION and loaded.tiers == plan.tiers
    assert [layer.groups for layer in loaded.layers] == [layer.groups for layer in plan.layers]
    assert all(layer.magnitudes is None for layer in loaded.layers)
    engine = Engine.load(EngineSettings(model=folder, backend="cpu", plan=tmp_path / "old.json"))
    assert engine.residency.accelerator_groups == 0 and engine.residency.cpu_groups > 0


def test_a_version_2_plan_still_loads_its_overflow_policy_dropped_for_the_runs_own(tmp_path):
    """Version 2 recorded an overflow policy that decided nothing: the run's settings always chose."""
    plan = plan_for()
    (tmp_path / "v2.json").write_text(json.dumps({**plan.to_dict(), "version": 2, "overflow": "prune"}))
    loaded = ExpertPlan.load(tmp_path / "v2.json")
    assert loaded.version == PLAN_VERSION and loaded.layers == plan.layers
    assert "overflow" not in loaded.to_dict()


def test_a_static_backend_without_a_plan_is_refused(qwen3_plan):
    folder, _ = qwen3_plan
    with pytest.raises(ValueError, match="torch-static backend runs planned groups: give it a plan"):
        MoeRuntime(load_model(folder).model, get_backend("torch-static"))


def test_a_plan_for_another_architecture_is_refused(qwen3_plan, tiny):
    _, plan = qwen3_plan
    with pytest.raises(PlanError, match="has 32 experts, the model 16"):
        MoeRuntime(load_model(tiny("qwen2_moe")).model, get_backend("torch-static"), plan)


def test_a_plan_calibrated_for_other_weights_is_refused(qwen3_plan, tiny, tmp_path):
    _, plan = qwen3_plan
    plan.save(tmp_path / "plan.json")
    other = tiny("qwen3_moe", seed=1)
    with pytest.raises(PlanError, match="calibrated for model@"):
        Engine.load(EngineSettings(model=str(other), backend="torch-static", plan=tmp_path / "plan.json"))


def test_calibrate_plan_writes_the_plan_it_returns_showing_progress_only_while_calibrating(tiny, harbour, tmp_path):
    seen: list[tuple[int, int] | str] = []

    @contextmanager
    def progress():
        seen.append("open")
        yield lambda done, total: seen.append((done, total))
        seen.append("closed")

    folder = tiny("olmoe")
    plan = calibrate_plan(folder, [("harbour", harbour)], tmp_path / "plan.json", chunk_tokens=128, group_size=2,
                          progress=progress())
    assert ExpertPlan.load(tmp_path / "plan.json") == plan
    assert (plan.model_key, plan.chunk_tokens, plan.group_size, plan.sources) == (
        load_model(folder).key, 128, 2, ("harbour",))
    assert all(layer.magnitudes is not None and max(layer.magnitudes.output) > 0 for layer in plan.layers)
    total = len(seen) - 2
    assert seen == ["open", *((done, total) for done in range(1, total + 1)), "closed"]
