"""The cuda backend without a GPU: its group graph run eagerly (capture off) on the CPU, its future's ordering,
its residency on synthetic device costs, and its refusal where torch finds no CUDA device."""

from __future__ import annotations

import re
import threading

import pytest
import torch

from npumoe.engine import EngineSettings
from npumoe.engine.backends.base import TorchStaticBackend
from npumoe.engine.backends.cuda.backend import CudaBackend
from npumoe.engine.backends.cuda.env import cuda_availability
from npumoe.engine.backends.cuda.graph import DeviceGroupGraph
from npumoe.engine.backends.registry import backend_class, get_backend
from npumoe.engine.calibration.calibrate import Calibration
from npumoe.engine.calibration.planner import make_plan
from npumoe.engine.moe.cpu_experts import CpuExperts
from npumoe.engine.moe.dispatch import DispatchStats, MoeLayer, StaticGroup
from npumoe.engine.moe.experts_layout import DEFAULT_LAYOUT, ExpertsLayout, ExpertWeights
from npumoe.engine.moe.grouped import GroupedExperts
from npumoe.engine.plan.cost import CostModel
from npumoe.engine.plan.expert_plan import ExpertLoad
from npumoe.engine.plan.residency import CHEAPER, MEMORY, MeasuredCosts, decide_residency

E, H, FFN, TOKENS, TOP_K = 8, 16, 8, 24, 2
GPU_LIKE = CostModel(launch_s=1e-5, static_flops=1e14, cpu_call_s=1e-4, cpu_flops=1e10)
no_gpu = pytest.mark.skipif(cuda_availability()[0], reason="this machine has a GPU: the refusal cannot be seen")


def experts(layout: ExpertsLayout = DEFAULT_LAYOUT, dtype: torch.dtype = torch.float32) -> ExpertWeights:
    g = torch.Generator().manual_seed(0)
    bias = layout.bias
    return ExpertWeights(torch.randn(E, layout.projections * FFN, H, generator=g).to(dtype),
                         torch.randn(E, H, FFN, generator=g).to(dtype),
                         torch.randn(E, layout.projections * FFN, generator=g).to(dtype) if bias else None,
                         torch.randn(E, H, generator=g).to(dtype) if bias else None)


def cpu_backend() -> CudaBackend:
    """The cuda backend's classes on the CPU: graphs run eagerly on their buffers, on its worker thread."""
    return CudaBackend("cpu", capture=False)


def routing(seed: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, H, generator=g)
    index = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(TOKENS)])
    return x, index, torch.rand(TOKENS, TOP_K, generator=g).softmax(-1)


@pytest.mark.parametrize("layout", [DEFAULT_LAYOUT, ExpertsLayout(activation="gelu", gate=None, bias=True)],
                         ids=["silu-glu", "gelu-biases"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_group_graph_with_capture_off_computes_what_torch_static_computes(layout, dtype):
    weights = experts(layout, dtype).select([1, 4, 6])
    graph = cpu_backend().build_group(weights, layout, capacity=5)
    x = torch.randn(3, 5, H).to(dtype)
    assert isinstance(graph, DeviceGroupGraph) and graph.graph is None  # nothing captured: the module ran
    assert torch.equal(graph(x), TorchStaticBackend().build_group(weights, layout, 5)(x))
    assert graph.staged_in.data_ptr() != x.data_ptr() and torch.equal(graph.staged_in, x)  # staged, then run


def test_capture_needs_a_cuda_device():
    with pytest.raises(ValueError, match="CUDA graphs are captured on a CUDA device, not cpu"):
        CudaBackend("cpu").build_group(experts(), DEFAULT_LAYOUT, 4)


def test_a_moe_layer_on_the_cuda_backend_equals_the_exact_cpu_path_with_spills():
    weights = experts()
    backend = cpu_backend()
    groups = [StaticGroup(ids, 4, backend.build_group(weights.select(ids), DEFAULT_LAYOUT, 4))
              for ids in ((0, 1, 2), (3, 4))]  # capacity 4 of ~6 tokens an expert: spills; 5, 6, 7 cold
    layer = MoeLayer(weights, groups=groups, submit=backend.submit)
    x, index, router = routing()
    stats = DispatchStats()
    torch.testing.assert_close(layer(x, index, router, stats), MoeLayer(weights).exact(x, index, router))
    assert stats.static > 0 and stats.spilled > 0 and stats.cpu > 0 and stats.launches == 2


class WaitsForTheCpu(GroupedExperts):
    """A group module that finishes only once the CPU experts have run: it deadlocks if the graphs are run before
    the caller's CPU work starts, and records what it saw when it ran."""

    def __init__(self, weights: ExpertWeights, cpu_ran: threading.Event) -> None:
        super().__init__(weights)
        self.cpu_ran = cpu_ran
        self.saw_cpu_work: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.saw_cpu_work.append(self.cpu_ran.wait(timeout=30))
        return super().forward(x)


class CountingCpuExperts(CpuExperts):
    def __init__(self, weights: ExpertWeights, cpu_ran: threading.Event) -> None:
        super().__init__(weights, DEFAULT_LAYOUT)
        self.cpu_ran = cpu_ran
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        self.cpu_ran.set()
        return super().__call__(*args, **kwargs)


def test_the_cpu_experts_run_while_the_group_graphs_are_pending():
    weights = experts()
    cpu_ran = threading.Event()
    backend = cpu_backend()
    module = WaitsForTheCpu(weights.select([0, 1, 2, 3]), cpu_ran)
    graph = DeviceGroupGraph(module, 8, backend.device, capture=False)
    cpu = CountingCpuExperts(weights, cpu_ran)
    layer = MoeLayer(weights, groups=[StaticGroup((0, 1, 2, 3), 8, graph)], submit=backend.submit, experts=cpu)
    x, index, router = routing()
    y = layer(x, index, router)
    assert module.saw_cpu_work == [True] and cpu.calls > 0  # the graph waited for the CPU experts, which ran first
    torch.testing.assert_close(y, MoeLayer(weights).exact(x, index, router))


def device_plan():
    """One layer of 8 experts in 4 groups of 2, each busier than the next."""
    mean = (40.0, 40.0, 20.0, 20.0, 10.0, 10.0, 5.0, 5.0)
    load = ExpertLoad(mean=mean, p50=mean, p95=mean, max=mean)
    calibration = Calibration(chunk_tokens=64, tokens=640, chunks=10, sources=("synthetic",),
                              layers=(("layers.0.experts", load),))
    return make_plan(calibration, model="synthetic", model_key="synthetic@0", group_size=2, n_tiers=1)


def test_groups_go_to_the_gpu_where_its_measured_costs_favour_it_and_its_memory_holds_them():
    plan = device_plan()
    roomy = decide_residency(plan, CudaBackend, MeasuredCosts(GPU_LIKE, 2048, 768, "cuda on a test GPU"))
    assert [(p.accelerator, p.reason) for p in roomy.placements()] == [(True, CHEAPER)] * 4
    tight = decide_residency(plan, CudaBackend, MeasuredCosts(GPU_LIKE, 2048, 768, "cuda on a test GPU",
                                                              device_experts=5))
    busiest = [plan.layers[0].load.mean[group.experts[0]] for group in plan.layers[0].groups]
    kept = {mean: (p.accelerator, p.reason) for mean, p in zip(busiest, tight.placements(), strict=True)}
    # room for 5 experts: the two groups that save the most (the busiest) stay, the others go to the CPU
    assert kept == {40.0: (True, CHEAPER), 20.0: (True, CHEAPER), 10.0: (False, MEMORY), 5.0: (False, MEMORY)}


def test_measured_device_room_survives_the_cost_cache():
    costs = MeasuredCosts(GPU_LIKE, 2048, 768, "cuda on a test GPU", device_experts=1234)
    assert MeasuredCosts.from_dict(costs.to_dict()) == costs
    older = costs.to_dict()
    del older["device_experts"]  # a file written before the field: no limit
    assert MeasuredCosts.from_dict(older).device_experts is None


def test_a_cpu_device_claims_no_room_of_its_own():
    assert cpu_backend().device_room(2048, 768, torch.bfloat16) is None


@no_gpu
def test_without_a_gpu_the_cuda_backend_is_refused_with_the_reason():
    reason = cuda_availability()[1]
    assert reason.startswith(f"torch {torch.__version__}")
    refusal = f"the cuda backend needs an NVIDIA GPU that torch can use: {reason}"
    with pytest.raises(ValueError, match=re.escape(refusal)):
        get_backend("cuda")
    with pytest.raises(ValueError, match="the cuda backend needs an NVIDIA GPU"):
        EngineSettings(model="m", backend="cuda")
    assert backend_class("cuda").static and backend_class("cuda").fallback_reason() is None
