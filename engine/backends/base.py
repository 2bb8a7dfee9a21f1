"""Executor backends: how a group graph is built and run, and what running it costs here.

`cpu` has no static graphs: every expert runs on the exact dynamic-shape path. `torch-static`
runs each group as a `GroupedExperts` module with fixed (G, C, H) shapes: the reference semantics
for accelerators, available everywhere. The others (`coreml`, `cuda`) build their graphs
from the same `GroupedExperts` module, and run a layer's graphs on their device (`submit`) while the
CPU runs the cold experts.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..kernels.workers import run_tasks
from ..moe.cpu_experts import CpuExperts
from ..moe.dispatch import GraphCalls, GroupGraph, MoeLayer, Routed, StaticGroup, run_now
from ..moe.experts_layout import DEFAULT_LAYOUT, ExpertsLayout, ExpertWeights
from ..moe.grouped import GroupedExperts, PackedGroup
from ..plan.cost import CostModel, expert_flops, fit_call_cost, seconds_of
from ..vocabulary import CPU, DEFAULT_COMPUTE_UNITS, STATIC_BACKENDS, TORCH_STATIC

if TYPE_CHECKING:
    from ..plan.residency import GroupMeasure

# Rows per call for the two-point cost fit: one row shows the fixed cost, a full chunk the throughput.
FIT_ROWS = (1, 256)


@dataclass(frozen=True)
class BackendOptions:
    """What building a backend may take besides its name; each backend reads only what it needs."""

    compiled_dir: Path | None = None  # where `npumoed compile` put the Core ML graphs; coreml needs it
    compute_units: str = DEFAULT_COMPUTE_UNITS  # where Core ML may run them
    weights: str | None = None  # the [model] weights format (vocabulary.WEIGHTS): coreml runs packages stored in it


NO_OPTIONS = BackendOptions()


@dataclass(frozen=True)
class GroupSpec:
    """One group graph a backend may build: G experts' weights of one layout, capacity and fp16 scale. `packed`:
    the engine's packed CPU copy of the layer's experts and the group's ids in it, where the engine holds them so
    (then `weights` may be placeholders: their values live only there)."""

    weights: ExpertWeights
    layout: ExpertsLayout
    capacity: int
    scale: float = 1.0
    packed: tuple[CpuExperts, tuple[int, ...]] | None = None


class Backend:
    name: str = ""
    static: bool = False  # whether it runs group graphs (and so can use an ExpertPlan)
    capacity_multiple: int = 1  # its graphs' capacities are padded to a multiple of this
    fp16: bool = False  # whether its graphs compute in fp16 (so calibrated magnitudes must fit it)
    # whether its graphs are made from the experts' float weights (a converted or captured graph holds its own
    # copy), so a planned run must load them unpacked; else its groups run from the packed copy the CPU path reads
    graphs_from_float: bool = False

    @classmethod
    def check(cls, options: BackendOptions) -> None:
        """Refuse options this backend cannot run with, before anything is loaded for it."""

    @classmethod
    def build(cls, options: BackendOptions) -> Backend:
        """This backend as `options` ask for it; cpu and torch-static need none."""
        cls.check(options)
        return cls()

    def static_problem(self, layout: ExpertsLayout) -> str | None:
        """Why experts of this layout cannot run in this backend's group graphs; None when they can."""
        return None

    @classmethod
    def fallback_reason(cls) -> str | None:
        """Why this backend's graphs run through torch here instead of on its device; None when they do not."""
        return None

    def build_group(self, weights: ExpertWeights, layout: ExpertsLayout, capacity: int,
                    scale: float = 1.0) -> GroupGraph:
        """A (G, C, H) -> (G, C, H) graph for G experts' weights of this layout at capacity C (a compiled
        backend builds one graph per shape; torch runs any). An fp16 backend computes the values divided by
        `scale` inside its graph and multiplies them back; the others ignore it."""
        raise ValueError(f"the {self.name} backend has no static graphs; plans need a static backend "
                         f"({', '.join(STATIC_BACKENDS)})")

    def build_spec(self, spec: GroupSpec) -> GroupGraph:
        """The graph `spec` describes: from its experts' float weights (`build_group`), or from the packed copy
        where the backend runs that."""
        if spec.packed is not None and not self.graphs_from_float:
            return PackedGroup(*spec.packed)
        return self.build_group(spec.weights, spec.layout, spec.capacity, spec.scale)

    def submit(self, calls: GraphCalls) -> Future[list[torch.Tensor]]:
        """Start a layer's group graphs; the future holds their outputs. Here they run at once, in the
        caller's thread: a backend with a device of its own runs them there while the CPU works."""
        return run_now(calls)

    def measure_costs(self, hidden: int, ffn: int, dtype: torch.dtype, group_size: int) -> CostModel:
        """Time this backend's group graphs and the exact CPU path at the model's expert geometry."""
        raise ValueError(f"the {self.name} backend has no static graphs to measure")

    def device_room(self, hidden: int, ffn: int, dtype: torch.dtype) -> int | None:
        """How many experts' weights at this geometry the backend's device can hold beside what it holds already;
        None: no limit of its own (its graphs run in host memory)."""
        return None

    def time_groups(self, groups: Mapping[str, GroupSpec]) -> dict[str, GroupMeasure]:
        """Each group's own graph timed on the backend's device (and where its ops run), by the caller's keys;
        empty for a backend whose cost model covers its graphs (torch runs any shape at the measured rate)."""
        return {}


class CpuBackend(Backend):
    name = CPU


class TorchStaticBackend(Backend):
    name = TORCH_STATIC
    static = True

    def build_group(self, weights: ExpertWeights, layout: ExpertsLayout, capacity: int,
                    scale: float = 1.0) -> GroupGraph:
        return GroupedExperts(weights, layout).eval()

    @torch.inference_mode()
    def measure_costs(self, hidden: int, ffn: int, dtype: torch.dtype, group_size: int) -> CostModel:
        weights = sample_weights(group_size, hidden, ffn, dtype)
        graph = GroupedExperts(weights)
        launch_s, static_flops = fit_call_cost(
            lambda rows: graph(torch.ones(group_size, rows, hidden, dtype=dtype)), *FIT_ROWS,
            flops=lambda rows: expert_flops(group_size * rows, hidden, ffn))
        calls_s, cpu_flops = cpu_path_costs(weights)
        return CostModel(launch_s=launch_s, static_flops=static_flops, cpu_call_s=calls_s / group_size,
                         cpu_flops=cpu_flops, host_row_s=host_row_seconds(hidden, dtype, group_size))


def sample_weights(group_size: int, hidden: int, ffn: int, dtype: torch.dtype) -> ExpertWeights:
    """G random experts at this geometry, the same on every call: what costs are measured on."""
    generator = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(group_size, 2 * ffn, hidden, generator=generator) / hidden**0.5).to(dtype)
    down = (torch.randn(group_size, hidden, ffn, generator=generator) / ffn**0.5).to(dtype)
    return ExpertWeights(gate_up, down)


def cpu_path_costs(weights: ExpertWeights) -> tuple[float, float]:
    """(fixed seconds of the G experts' calls together, FLOP/s) of the exact CPU path on these experts. It runs them
    side by side, as a layer does: its fixed cost per call is that of the G calls shared out over the workers, its
    throughput that of all of them."""
    cpu = CpuExperts(weights, DEFAULT_LAYOUT)
    group_size, hidden, ffn = len(weights), weights.hidden, weights.ffn

    def cpu_path(rows: int) -> None:
        x = torch.ones(rows, hidden, dtype=weights.down.dtype)
        run_tasks([lambda e=e: cpu(e, x) for e in range(group_size)])

    return fit_call_cost(cpu_path, *FIT_ROWS, flops=lambda rows: expert_flops(group_size * rows, hidden, ffn))


def host_row_seconds(hidden: int, dtype: torch.dtype, experts: int, rows: int = 2048, repeats: int = 10) -> float:
    """Seconds per filled row of the host's work around a layer's graphs, as dispatch does it (`MoeLayer.pack` and
    `unpack`: each expert's rows gathered into its buffer slice and copied out, one task per expert over the
    workers): `rows` token rows spread evenly over a group of `experts`; best of `repeats`."""
    generator = torch.Generator().manual_seed(0)
    weights = ExpertWeights(torch.randn(experts, 2, hidden, generator=generator).to(dtype),
                            torch.randn(experts, hidden, 1, generator=generator).to(dtype))  # never run: packing only
    per_expert = rows // experts
    layer = MoeLayer(weights, groups=[StaticGroup(tuple(range(experts)), per_expert, lambda x: x)])
    x = torch.ones(rows, hidden, dtype=dtype)
    expert = torch.randperm(rows, generator=torch.Generator().manual_seed(0)) % experts
    counts = torch.bincount(expert, minlength=experts)
    routed = Routed.from_order(expert[:, None], torch.argsort(expert, stable=True), counts)
    static_counts = layer.static_per_expert(counts)
    out = torch.empty(rows, hidden, dtype=dtype)

    def run(_: int) -> None:
        packed = layer.pack(x, routed, static_counts)
        layer.unpack(out, {0: layer.buffer(packed, 0)}, routed, static_counts)

    run(rows)
    return min(seconds_of(run, rows) for _ in range(repeats)) / (per_expert * experts)
