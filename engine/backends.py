"""Executor backends: how a group graph is built and run, and what running it costs here.

`cpu` has no static graphs: every expert runs on the exact dynamic-shape path. `torch-static`
runs each group as a `GroupedExperts` module with fixed (G, C, H) shapes: the reference semantics
for accelerators, available everywhere. Later backends (Core ML, CUDA graphs) build their graphs
from the same `GroupedExperts` module.
"""

from __future__ import annotations

import torch

from .cost import CostModel, expert_flops, fit_call_cost
from .dispatch import GroupGraph, expert_ffn
from .grouped import GroupedExperts

# Rows per call for the two-point cost fit: one row shows the fixed cost, a full chunk the throughput.
_FIT_ROWS = (1, 256)


class Backend:
    name: str = ""
    static: bool = False  # whether it runs group graphs (and so can use an ExpertPlan)

    def build_group(self, gate_up: torch.Tensor, down: torch.Tensor, act: str, capacity: int) -> GroupGraph:
        """A (G, C, H) -> (G, C, H) graph for G experts' weights, gate_up (G, 2I, H), down (G, H, I), at
        capacity C (a compiled backend builds one graph per shape; torch runs any)."""
        raise ValueError(f"the {self.name} backend has no static graphs; plans need a static backend "
                         f"({', '.join(n for n, b in BACKENDS.items() if b.static)})")

    def measure_costs(self, hidden: int, ffn: int, dtype: torch.dtype, group_size: int) -> CostModel:
        """Time this backend's group graphs and the exact CPU path at the model's expert geometry."""
        raise ValueError(f"the {self.name} backend has no static graphs to measure")


class CpuBackend(Backend):
    name = "cpu"


class TorchStaticBackend(Backend):
    name = "torch-static"
    static = True

    def build_group(self, gate_up: torch.Tensor, down: torch.Tensor, act: str, capacity: int) -> GroupGraph:
        return GroupedExperts(gate_up.detach(), down.detach(), act=act).eval()

    @torch.inference_mode()
    def measure_costs(self, hidden: int, ffn: int, dtype: torch.dtype, group_size: int) -> CostModel:
        generator = torch.Generator().manual_seed(0)
        gate_up = (torch.randn(group_size, 2 * ffn, hidden, generator=generator) / hidden**0.5).to(dtype)
        down = (torch.randn(group_size, hidden, ffn, generator=generator) / ffn**0.5).to(dtype)
        graph = GroupedExperts(gate_up, down)
        launch_s, static_flops = fit_call_cost(
            lambda rows: graph(torch.ones(group_size, rows, hidden, dtype=dtype)), *_FIT_ROWS,
            flops=lambda rows: expert_flops(group_size * rows, hidden, ffn))
        call_s, cpu_flops = fit_call_cost(
            lambda rows: expert_ffn(torch.ones(rows, hidden, dtype=dtype), gate_up[0], down[0], graph.act),
            *_FIT_ROWS, flops=lambda rows: expert_flops(rows, hidden, ffn))
        return CostModel(launch_s=launch_s, static_flops=static_flops, cpu_call_s=call_s, cpu_flops=cpu_flops)


BACKENDS: dict[str, Backend] = {backend.name: backend for backend in (CpuBackend(), TorchStaticBackend())}


def get_backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return BACKENDS[name]
