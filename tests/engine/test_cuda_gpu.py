"""The cuda backend on an NVIDIA GPU: captured graphs against the same module run eagerly, a whole MoE model on the
GPU against the exact CPU path, residency measured there. Marked `gpu`: skipped where torch finds no GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from npumoe.engine.attach.runtime import MoeRuntime
from npumoe.engine.backends.cuda.backend import CudaBackend
from npumoe.engine.backends.cuda.env import cuda_availability
from npumoe.engine.backends.placement import measure, place
from npumoe.engine.backends.registry import get_backend
from npumoe.engine.calibration.calibrate import Calibration
from npumoe.engine.calibration.planner import make_plan
from npumoe.engine.loading.load import load_model
from npumoe.engine.moe.experts_layout import DEFAULT_LAYOUT, ExpertWeights
from npumoe.engine.moe.grouped import GroupedExperts
from npumoe.engine.moe.model_experts import moe_experts
from npumoe.engine.plan.expert_plan import ExpertLoad
from npumoe.engine.plan.residency import CHEAPER, IDLE
from npumoe.engine.vocabulary import SPILL

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_availability()[0], reason=cuda_availability()[1])]

G, C, H, FFN = 4, 48, 256, 128
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def group(dtype: torch.dtype) -> ExpertWeights:
    g = torch.Generator().manual_seed(0)
    return ExpertWeights((torch.randn(G, 2 * FFN, H, generator=g) / H**0.5).to(dtype),
                         (torch.randn(G, H, FFN, generator=g) / FFN**0.5).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_captured_graph_computes_what_the_module_computes_eagerly_on_every_replay(dtype):
    weights = group(dtype)
    captured = CudaBackend().build_group(weights, DEFAULT_LAYOUT, C)
    eager = CudaBackend(capture=False).build_group(weights, DEFAULT_LAYOUT, C)
    assert captured.graph is not None and eager.graph is None
    assert captured.module.down.device.type == "cuda"  # the weights live on the GPU
    for seed in (1, 2):  # a second replay reads the new input from the same static buffer
        x = torch.randn(G, C, H, generator=torch.Generator().manual_seed(seed)).to(dtype)
        torch.testing.assert_close(captured(x), eager(x), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def test_submit_hands_back_each_graphs_output_once_its_event_fires():
    weights = group(torch.bfloat16)
    backend = CudaBackend()
    experts = [weights.select([e, e + 1]) for e in (0, 2)]
    graphs = [backend.build_group(w, DEFAULT_LAYOUT, C) for w in experts]
    inputs = [torch.randn(2, C, H, generator=torch.Generator().manual_seed(e)).to(torch.bfloat16) for e in (3, 4)]
    outputs = backend.submit(list(zip(graphs, inputs, strict=True))).result(timeout=60)
    assert all(y.is_pinned() for y in outputs)  # the graphs' own staging buffers, copied back into by the device
    for w, x, y in zip(experts, inputs, outputs, strict=True):
        want = GroupedExperts(w.to(torch.float32))(x.float())  # on the CPU, in fp32
        torch.testing.assert_close(y.float(), want, rtol=2e-2, atol=2e-2)


@pytest.fixture
def loaded_with_plan(tiny_model: Path):
    """The tiny model and a plan whose tiers hold fewer tokens than a chunk routes to most experts (so some spill),
    its last group idle in calibration (so it stays on the CPU)."""
    loaded = load_model(tiny_model)
    experts = loaded.model.config.num_experts
    need = tuple(0.0 if e >= experts - 4 else float(2 * (1 + e % 3)) for e in range(experts))
    load = ExpertLoad(mean=need, p50=need, p95=need, max=need)
    calibration = Calibration(chunk_tokens=64, tokens=640, chunks=10, sources=("test",),
                              layers=tuple((name, load) for name, _ in moe_experts(loaded.model)))
    return loaded, make_plan(calibration, model="tiny", model_key=loaded.key)


def test_a_moe_model_on_the_gpu_equals_the_exact_cpu_path_with_spills(loaded_with_plan):
    loaded, plan = loaded_with_plan
    ids = torch.randint(loaded.model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        exact = MoeRuntime(loaded.model, get_backend("cpu"))
        want = loaded.model(ids).logits
        exact.detach()
        runtime = MoeRuntime(loaded.model, get_backend("cuda"), plan, SPILL)
        got = loaded.model(ids).logits
    stats = runtime.stats
    assert stats.static > 0 and stats.spilled > 0 and stats.cpu > 0, stats  # on the GPU, spilled and cold on the CPU
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_residency_is_decided_from_costs_measured_on_the_gpu(loaded_with_plan):
    loaded, plan = loaded_with_plan
    backend = get_backend("cuda")
    costs = measure(plan, backend, loaded.model)
    assert costs.measured_on.startswith("cuda on ") and costs.fallback is None
    assert costs.groups and all(m.seconds > 0 for m in costs.groups.values())  # each group's own graph, timed
    assert costs.device_experts is not None and costs.device_experts > sum(len(g.experts) for layer in plan.layers
                                                                            for g in layer.groups)
    residency = place(plan, backend, loaded.model, cache=None)
    assert residency.measured_on == costs.measured_on
    assert {p.reason for p in residency.placements()} <= {CHEAPER, IDLE}  # the measured costs decided each group
