"""On a Mac: the `coreml` backend's graphs compute what `torch-static` computes, on the tiny model.

Core ML predicts only on macOS 15+ with its native bindings, so these tests are marked `macos` and
skipped elsewhere; they have not been run on the project's own (Linux) machines.
"""

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from coreml_compare import logits_by_backend

from npumoe.engine.backends.base import GroupSpec, TorchStaticBackend
from npumoe.engine.backends.coreml.backend import CoreMLBackend, CoreMLGroupGraph
from npumoe.engine.backends.coreml.cache import build_folder
from npumoe.engine.backends.coreml.convert import build_packages, plan_digest, plan_group_graphs
from npumoe.engine.backends.coreml.env import coreml_availability, coremltools_version
from npumoe.engine.backends.placement import place
from npumoe.engine.backends.registry import backend_class
from npumoe.engine.loading.load import load_model
from npumoe.engine.moe.experts_layout import expert_weights
from npumoe.engine.moe.model_experts import moe_layouts
from npumoe.engine.plan.cost_cache import CostCache
from npumoe.engine.plan.residency import decide_residency, group_key

pytestmark = [pytest.mark.macos, pytest.mark.skipif(sys.platform != "darwin", reason="Core ML predicts only on macOS")]


@pytest.fixture
def compiled(tiny_model: Path, coreml_plan: Callable, tmp_path: Path) -> tuple:
    """(loaded tiny model, its coreml plan, a cache root holding the plan's compiled groups)."""
    available, reason = coreml_availability()
    if not available:
        pytest.skip(reason)
    loaded = load_model(tiny_model)
    _, plan = coreml_plan()
    modules = {name: (module, layout) for name, module, layout in moe_layouts(loaded.model)}
    weights = [expert_weights(*modules[layer.name]) for layer in plan.layers]
    groups = plan_group_graphs(plan, decide_residency(plan, backend_class("coreml")))
    root = tmp_path / "compiled"
    build_packages(groups, weights.__getitem__, modules[plan.layers[0].name][1],
                   build_folder(root, loaded.key, plan_digest(plan, groups), coremltools_version()),
                   model=loaded.key, digest=plan_digest(plan, groups))
    return loaded, plan, root


def test_each_group_graph_agrees_with_torch_static(compiled: tuple) -> None:
    loaded, plan, root = compiled
    backend, reference = CoreMLBackend(root), TorchStaticBackend()
    modules = {name: (module, layout) for name, module, layout in moe_layouts(loaded.model)}
    generator = torch.Generator().manual_seed(0)
    candidates = decide_residency(plan, backend)
    specs = {}
    for i, (layer, placements) in enumerate(zip(plan.layers, candidates.layers, strict=True)):
        weights, layout = expert_weights(*modules[layer.name]), modules[layer.name][1]
        for g, (group, placement) in enumerate(zip(layer.groups, placements, strict=True)):
            if not placement.accelerator:
                continue
            ids, capacity = group.experts, placement.capacity
            args = (weights.select(ids), layout, capacity)
            graph = backend.build_group(*args)
            assert isinstance(graph, CoreMLGroupGraph) and graph.model is None  # Core ML, loaded when first used
            x = torch.randn(len(ids), capacity, weights.hidden, generator=generator)
            torch.testing.assert_close(graph(x), reference.build_group(*args)(x), rtol=2e-2, atol=2e-2)
            specs[group_key(i, g)] = GroupSpec(*args)
    measured = backend.time_groups(specs)
    assert sorted(measured) == sorted(specs)
    assert all(m.seconds > 0 and 0 <= m.device_ops <= m.ops and m.ops > 0 for m in measured.values())


@torch.inference_mode()
def test_model_logits_agree_between_coreml_and_torch_static(compiled: tuple) -> None:
    loaded, plan, root = compiled
    ids = torch.randint(0, loaded.model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
    logits = logits_by_backend(loaded, plan, root, ids)
    error = (logits["coreml"] - logits["torch-static"]).norm() / logits["torch-static"].norm()
    assert error < 1e-2  # fp16 expert graphs against fp32 ones


def test_measured_costs_come_from_core_ml_graphs(compiled: tuple) -> None:
    loaded, _, root = compiled
    config = loaded.model.config
    costs = CoreMLBackend(root).measure_costs(config.hidden_size, config.moe_intermediate_size, torch.float32, 4)
    assert costs.launch_s > 0 and costs.static_flops > 0


def test_first_load_times_every_compiled_function_and_residency_reads_it(compiled: tuple, tmp_path: Path) -> None:
    """The first load measures on the Neural Engine (graph timings, placement) and caches it; the next reads it."""
    loaded, plan, root = compiled
    cache = CostCache(tmp_path / "costs")
    placed = place(plan, CoreMLBackend(root), loaded.model, cache)
    costs = cache.get("coreml", plan)
    assert costs is not None and costs.fallback is None and costs.measured_on.startswith("coreml on ")
    candidates = decide_residency(plan, backend_class("coreml"))
    assert sorted(costs.groups) == sorted(group_key(i, g) for i, layer in enumerate(candidates.layers)
                                          for g, p in enumerate(layer) if p.accelerator)
    assert place(plan, CoreMLBackend(root), loaded.model, cache) == placed  # read back, not measured again
    for key, measure in costs.groups.items():
        print(f"{key}: {measure.seconds * 1e6:.0f} us, {measure.device_ops}/{measure.ops} ops on the Neural Engine")


def test_the_group_graphs_ops_are_placed_on_the_neural_engine(compiled: tuple, tmp_path: Path) -> None:
    loaded, plan, root = compiled
    cache = CostCache(tmp_path / "costs")
    place(plan, CoreMLBackend(root), loaded.model, cache)
    costs = cache.get("coreml", plan)
    on_engine = sum(m.device_ops for m in costs.groups.values())
    ops = sum(m.ops for m in costs.groups.values())
    assert ops > 0 and on_engine == ops  # grouped 1x1 convolutions in fp16: nothing should fall off
