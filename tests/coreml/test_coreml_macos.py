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

from npumoe.engine.backends import TorchStaticBackend
from npumoe.engine.coreml.backend import CoreMLBackend, CoreMLGroupGraph
from npumoe.engine.coreml.cache import build_folder
from npumoe.engine.coreml.convert import build_packages, plan_digest, plan_group_graphs
from npumoe.engine.coreml.env import coreml_availability, import_coremltools
from npumoe.engine.experts_layout import expert_weights
from npumoe.engine.models import load_model, moe_layouts

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
    groups = plan_group_graphs(plan)
    root = tmp_path / "compiled"
    build_packages(groups, weights.__getitem__, modules[plan.layers[0].name][1],
                   build_folder(root, loaded.key, plan_digest(plan, groups), import_coremltools().__version__),
                   model=loaded.key, digest=plan_digest(plan, groups))
    return loaded, plan, root


def test_each_group_graph_agrees_with_torch_static(compiled: tuple) -> None:
    loaded, plan, root = compiled
    backend, reference = CoreMLBackend(root), TorchStaticBackend()
    modules = {name: (module, layout) for name, module, layout in moe_layouts(loaded.model)}
    generator = torch.Generator().manual_seed(0)
    for layer in plan.layers:
        weights, layout = expert_weights(*modules[layer.name]), modules[layer.name][1]
        for group in (g for g in layer.groups if g.residency == "accelerator"):
            ids, capacity = group.experts, plan.tiers[group.tier]
            args = (weights.select(ids), layout, capacity)
            graph = backend.build_group(*args)
            assert isinstance(graph, CoreMLGroupGraph)  # a Core ML prediction, not the torch fallback
            x = torch.randn(len(ids), capacity, weights.hidden, generator=generator)
            torch.testing.assert_close(graph(x), reference.build_group(*args)(x), rtol=2e-2, atol=2e-2)
    assert len(backend.graph_seconds) == len(plan_group_graphs(plan))
    assert all(seconds > 0 for seconds in backend.graph_seconds.values())


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
