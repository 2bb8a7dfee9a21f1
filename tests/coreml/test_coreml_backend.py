"""The `coreml` backend off macOS, and how it finds a group's compiled graph."""

import json
import logging
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from coreml_compare import logits_by_backend

from npumoe.engine import Engine, EngineSettings
from npumoe.engine.backends.coreml.backend import CoreMLBackend
from npumoe.engine.backends.coreml.cache import build_folder, compiled_groups, weights_fingerprint
from npumoe.engine.backends.coreml.convert import GroupGraph, build_packages
from npumoe.engine.backends.coreml.env import coreml_availability, import_coremltools
from npumoe.engine.loading.load import load_model
from npumoe.engine.moe.experts_layout import DEFAULT_LAYOUT, ExpertWeights
from npumoe.engine.moe.grouped import GroupedExperts
from npumoe.engine.plan.cost import CostModel
from npumoe.engine.plan.cost_cache import CostCache
from npumoe.engine.plan.residency import MeasuredCosts
from npumoe.engine.vocabulary import COMPUTE_UNITS

not_macos = pytest.mark.skipif(sys.platform == "darwin", reason="describes a machine without Core ML prediction")


def random_layer(experts: int = 8, hidden: int = 32, inter: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(experts, 2 * inter, hidden, generator=gen), torch.randn(experts, hidden, inter, generator=gen)


@not_macos
def test_availability_says_core_ml_needs_macos() -> None:
    available, reason = coreml_availability()
    assert not available
    assert "needs macOS" in reason


@not_macos
def test_without_core_ml_the_backend_says_why_once_and_runs_groups_in_torch(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    gate_up, down = random_layer()
    backend = CoreMLBackend(tmp_path)
    with caplog.at_level(logging.WARNING):
        graphs = [backend.build_group(ExpertWeights(gate_up[:4], down[:4]), DEFAULT_LAYOUT, capacity=8),
                  backend.build_group(ExpertWeights(gate_up[4:], down[4:]), DEFAULT_LAYOUT, capacity=8)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "needs macOS" in warnings[0] and "torch-static" in warnings[0]
    x = torch.randn(4, 8, 32)
    torch.testing.assert_close(graphs[1](x), GroupedExperts(ExpertWeights(gate_up[4:], down[4:]))(x))


def test_unknown_compute_units_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="compute units must be one of cpu_and_ne"):
        CoreMLBackend(tmp_path, compute_units="gpu_only")
    assert set(COMPUTE_UNITS) == {"cpu_and_ne", "all", "cpu_only", "cpu_and_gpu"}


def test_a_group_is_found_by_its_weights_and_capacity_in_any_finished_build(tmp_path: Path) -> None:
    gate_up, down = random_layer()
    version = import_coremltools().__version__
    groups = [GroupGraph(layer=0, capacity=16, experts=(6, 1, 2)), GroupGraph(layer=0, capacity=8, experts=(0, 3))]
    build_packages(groups, lambda layer: ExpertWeights(gate_up, down), DEFAULT_LAYOUT,
                   build_folder(tmp_path, "m@1", "p", version), model="m@1", digest="p")
    found = compiled_groups(tmp_path, version)

    experts = [6, 1, 2]
    folder, group = found[(weights_fingerprint(gate_up[experts], down[experts]), 16)]
    assert group.experts == (6, 1, 2) and (folder / group.package).is_dir()
    bf16 = found.get((weights_fingerprint(gate_up[experts].bfloat16(), down[experts].bfloat16()), 16))
    assert bf16 is not None and bf16[1] == group  # a bfloat16 load of the same checkpoint finds it too
    assert (weights_fingerprint(gate_up[experts], down[experts]), 8) not in found  # built at capacity 16 only
    assert (weights_fingerprint(gate_up[[6, 2, 1]], down[[6, 2, 1]]), 16) not in found  # other channel order


def test_unfinished_builds_are_never_found(tmp_path: Path) -> None:
    version = import_coremltools().__version__
    folder = build_folder(tmp_path, "m@1", "p", version)
    (folder / "experts-000.mlpackage").mkdir(parents=True)  # a build that died before its manifest
    assert compiled_groups(tmp_path, version) == {}


@pytest.mark.parametrize(("predicts", "thread"), [(True, "coreml"), (False, "MainThread")])
def test_submitted_group_graphs_run_in_order_on_the_worker_where_core_ml_predicts_else_at_once(
        tmp_path: Path, predicts: bool, thread: str) -> None:
    ran_on = []

    def double(x: torch.Tensor) -> torch.Tensor:
        ran_on.append(threading.current_thread().name)
        return 2 * x

    backend = CoreMLBackend(tmp_path)
    backend.available = predicts  # the graphs here are plain functions: only where they run is in question
    buffers = [torch.ones(2, 4, 8), torch.full((1, 8, 8), 3.0)]
    results = backend.submit([(double, b) for b in buffers]).result(timeout=10)
    assert [r.tolist() for r in results] == [(2 * b).tolist() for b in buffers]
    assert len(ran_on) == 2 and all(name.startswith(thread) for name in ran_on)


@not_macos
@torch.inference_mode()
def test_a_coreml_plan_runs_off_macos_with_torch_static_results(tiny_model: Path, coreml_plan: Callable,
                                                                tmp_path: Path) -> None:
    loaded = load_model(tiny_model)
    _, plan = coreml_plan()
    ids = torch.randint(0, loaded.model.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    logits = logits_by_backend(loaded, plan, tmp_path, ids)
    torch.testing.assert_close(logits["coreml"], logits["torch-static"], rtol=0, atol=0)


@not_macos
@torch.inference_mode()
def test_the_engine_builds_the_coreml_backend_from_its_settings_and_falls_back_to_torch_static(
        tiny_model: Path, coreml_plan: Callable, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path, plan = coreml_plan()
    # one plan, and the same costs for both backends: off macOS coreml's graphs are torch-static's
    costs = MeasuredCosts(CostModel(launch_s=1e-9, static_flops=1e15, cpu_call_s=1e-3, cpu_flops=1e9), 64, 32, "test")
    for backend in ("coreml", "torch-static"):
        CostCache(tmp_path / "costs").put(backend, plan, costs)
    ids = list(range(3, 51))
    with caplog.at_level(logging.WARNING):
        coreml = Engine.load(EngineSettings(model=str(tiny_model), backend="coreml", plan=path,
                                            compiled_dir=tmp_path / "compiled", coreml_compute_units="cpu_only",
                                            costs_dir=tmp_path / "costs"))
    assert [r.getMessage() for r in caplog.records if "torch-static instead" in r.getMessage()] != []
    static = Engine.load(EngineSettings(model=str(tiny_model), backend="torch-static", plan=path,
                                        costs_dir=tmp_path / "costs"))
    torch.testing.assert_close(coreml.logits(ids), static.logits(ids), rtol=0, atol=0)
    assert coreml.stats.static > 0  # the plan's groups ran (in torch)



def test_time_groups_loads_only_functions_placed_mostly_on_the_neural_engine(tmp_path: Path, monkeypatch) -> None:
    """The compute plan is read first: a function Core ML would run mostly off the Neural Engine stays on the CPU
    whatever its time, so it is never loaded to be timed; the other is loaded once and timed (Core ML faked)."""
    from npumoe.engine.backends.base import GroupSpec
    from npumoe.engine.backends.coreml import backend as coreml_backend
    from npumoe.engine.backends.coreml.cache import OUTPUT_NAME, CompiledGroup

    loads: list[str | None] = []

    class Identity:
        def predict(self, inputs: dict) -> dict:
            return {OUTPUT_NAME: next(iter(inputs.values()))}

    def load(path: Path, function: str | None) -> Identity:
        loads.append(function)
        return Identity()

    gate_up, down = random_layer(experts=4)
    weights = ExpertWeights(gate_up, down)
    functions = {16: "on_engine", 32: "off_engine"}  # found by capacity here
    backend = CoreMLBackend(tmp_path)
    backend.available = True
    monkeypatch.setattr(backend, "_find", lambda spec: (tmp_path, CompiledGroup(
        functions[spec.capacity], "p.mlpackage", 0, spec.capacity, (0, 1), "w")))
    monkeypatch.setattr(backend, "_load", load)
    monkeypatch.setattr(coreml_backend, "compiled_package", lambda folder, package: folder / package)
    monkeypatch.setattr(coreml_backend, "neural_engine_ops",
                        lambda package, units: {"on_engine": (9, 10), "off_engine": (2, 10)})
    specs = {"0/0": GroupSpec(weights.select([0, 1]), DEFAULT_LAYOUT, 16),
             "0/1": GroupSpec(weights.select([2, 3]), DEFAULT_LAYOUT, 32)}
    measured = backend.time_groups(specs)
    assert loads == ["on_engine"]  # loaded once, for its timing; the other never
    assert measured["0/0"].seconds is not None and measured["0/0"].seconds > 0
    assert measured["0/1"].seconds is None and measured["0/1"].mostly_off
    costs = MeasuredCosts(CostModel(1e-9, 1e15, 1e-3, 1e9), 32, 16, "test", groups=measured)
    assert MeasuredCosts.from_dict(json.loads(json.dumps(costs.to_dict()))).groups == measured  # cached as it is


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_a_core_ml_graph_hands_coremltools_float32_in_one_copy_which_core_ml_rounds_to_what_fp16_was(
        dtype: torch.dtype, scale: float) -> None:
    """coremltools turns an fp16 input into float32 before Core ML sees it, so the graph passes float32 (scaled)
    itself; Core ML rounding it to the function's fp16 gives what the fp16 input gave (Core ML faked: an identity
    that rounds its input to fp16, as the function's fp16 input does)."""
    import numpy as np

    from npumoe.engine.backends.coreml.backend import CoreMLGroupGraph
    from npumoe.engine.backends.coreml.cache import INPUT_NAME, OUTPUT_NAME

    seen: list[np.ndarray] = []

    class Fp16Identity:
        def predict(self, inputs: dict) -> dict:
            seen.append(inputs[INPUT_NAME])
            return {OUTPUT_NAME: inputs[INPUT_NAME].astype(np.float16)}

    x = (torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)  # (G, C, H)
    graph = CoreMLGroupGraph(Fp16Identity, n_experts=3, scale=scale)
    y = graph(x)
    assert seen[0].dtype == np.float32 and seen[0].shape == (1, 3 * 16, 1, 8)
    fp16_before = (x.transpose(1, 2).reshape(1, 3 * 16, 1, 8) / scale).to(torch.float16)  # what was passed before
    assert torch.equal(torch.from_numpy(seen[0].astype(np.float16)), fp16_before)
    torch.testing.assert_close(y, (fp16_before.reshape(3, 16, 8).transpose(1, 2).to(dtype) * scale), rtol=0, atol=0)
