"""The `cuda` backend: each resident group a CUDA graph on an NVIDIA GPU, its experts' weights held there.

CUDA graphs carry the Neural Engine's constraint (a graph replays fixed shapes at fixed addresses) and its payoff
(one launch runs every kernel of a group), so the plan's static groups map onto them directly: one captured graph
per (group, capacity) over the `GroupedExperts` module torch-static and Core ML build from, in the model's float
dtype (bf16 or fp32). A run with int8 or int4 experts quantizes them on the CPU path only: the groups on the GPU
hold the experts' bf16 weights, as torch-static's graphs do.

`submit` queues a layer's graphs on the backend's own stream (host staging, copy in, replay, copy out) and hands
back a future that a waiting thread completes when a CUDA event recorded after them fires, so the caller runs the
cold experts and the spills on the CPU meanwhile. Residency weighs measured costs: a launch with both copies and
the compute, fitted on sample graphs at the model's geometry (`measure_costs`), each group's own graph timed
(`time_groups`), and the experts the GPU's free memory holds (`device_room`). The dense parts (attention,
projections) stay on the CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ...kernels.choice import median_seconds
from ...moe.dispatch import GraphCalls, GroupGraph
from ...moe.experts_layout import DEFAULT_LAYOUT, ExpertsLayout, ExpertWeights
from ...moe.grouped import GroupedExperts
from ...plan.cost import CostModel, expert_flops, fit_call_cost
from ...plan.residency import GroupMeasure
from ...vocabulary import CUDA
from ..base import FIT_ROWS, Backend, BackendOptions, GroupSpec, cpu_path_costs, host_row_seconds, sample_weights
from .env import cuda_availability
from .graph import DeviceGroupGraph

# Device memory left out of the room for weights: the graphs' buffers and intermediates, cuBLAS's workspace, and
# what else the process allocates there (a tenth of the free memory, at least this much).
RESERVED_BYTES = 2 * 2**30
RESERVED_SHARE = 0.1


class CudaBackend(Backend):
    name = CUDA
    static = True
    capacity_multiple = 8  # tensor cores read the capacity axis in steps of 8 rows
    graphs_from_float = True  # a group's graph holds its own copy of the weights on the GPU

    @classmethod
    def check(cls, options: BackendOptions) -> None:
        available, reason = cuda_availability()
        if not available:
            raise ValueError(f"the cuda backend needs an NVIDIA GPU that torch can use: {reason}")

    def __init__(self, device: torch.device | str = "cuda", *, capture: bool = True) -> None:
        """`capture` off: the same modules run eagerly on the same buffers, one kernel launch at a time; on a
        CPU `device` (no GPU needed) the graphs run on the backend's worker thread."""
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.capture = capture
        on_gpu = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if on_gpu else None
        self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cuda")

    def build_group(self, weights: ExpertWeights, layout: ExpertsLayout, capacity: int,
                    scale: float = 1.0) -> DeviceGroupGraph:
        return DeviceGroupGraph(GroupedExperts(weights, layout).eval(), capacity, self.device, capture=self.capture)

    def submit(self, calls: GraphCalls) -> Future[list[torch.Tensor]]:
        """Queue a layer's group graphs on the backend's stream; the future completes when they are done (their
        outputs are the graphs' pinned buffers, good until each graph's next run)."""
        graphs = [(_device_graph(graph), x) for graph, x in calls]
        if self.stream is None:
            return self._waiter.submit(lambda: [graph(x) for graph, x in graphs])
        with torch.cuda.stream(self.stream):
            outputs = [graph.enqueue(x) for graph, x in graphs]
            done = torch.cuda.Event(blocking=True)  # its waiter sleeps: no core spins that the CPU experts want
            done.record(self.stream)

        def wait() -> list[torch.Tensor]:
            done.synchronize()  # releases the GIL: the CPU experts run meanwhile
            return outputs

        return self._waiter.submit(wait)

    @torch.inference_mode()
    def measure_costs(self, hidden: int, ffn: int, dtype: torch.dtype, group_size: int) -> CostModel:
        """A launch's fixed cost and its throughput from sample graphs at this geometry, run as `submit` runs
        them: staging, both copies and the compute, waited for; the CPU path's costs as torch-static measures them."""
        weights = sample_weights(group_size, hidden, ffn, dtype)
        graphs = {rows: self.build_group(weights, DEFAULT_LAYOUT, rows) for rows in FIT_ROWS}
        inputs = {rows: torch.ones(group_size, rows, hidden, dtype=dtype) for rows in FIT_ROWS}
        launch_s, flops = fit_call_cost(lambda rows: graphs[rows](inputs[rows]), *FIT_ROWS,
                                        flops=lambda rows: expert_flops(group_size * rows, hidden, ffn))
        calls_s, cpu_flops = cpu_path_costs(weights)
        return CostModel(launch_s=launch_s, static_flops=flops, cpu_call_s=calls_s / group_size, cpu_flops=cpu_flops,
                         host_row_s=host_row_seconds(hidden, dtype, group_size))

    def device_room(self, hidden: int, ffn: int, dtype: torch.dtype) -> int | None:
        """Experts (gated: 3·H·I weights each) that fit in the device's free memory, less what is reserved."""
        if self.device.type != "cuda":
            return None
        free, _ = torch.cuda.mem_get_info(self.device)
        room = free - max(RESERVED_BYTES, RESERVED_SHARE * free)
        return max(0, int(room // (3 * hidden * ffn * dtype.itemsize)))

    @torch.inference_mode()
    def time_groups(self, groups: Mapping[str, GroupSpec]) -> dict[str, GroupMeasure]:
        """Each group's own graph built and timed on the device, one at a time (its weights leave with it)."""
        measured = {}
        for key, spec in groups.items():
            graph = self.build_group(spec.weights, spec.layout, spec.capacity)
            example = torch.zeros(len(spec.weights), spec.capacity, spec.weights.hidden, dtype=spec.weights.down.dtype)
            measured[key] = GroupMeasure(seconds=median_seconds(lambda graph=graph, example=example: graph(example)))
            del graph
        return measured


def _device_graph(graph: GroupGraph) -> DeviceGroupGraph:
    if not isinstance(graph, DeviceGroupGraph):
        raise TypeError(f"the cuda backend runs the graphs it built, not {type(graph).__name__}")
    return graph
