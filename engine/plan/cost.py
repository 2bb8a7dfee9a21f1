"""The residency cost model: what a group graph launch and an exact CPU expert call cost.

Both are modelled as a fixed cost per call plus FLOPs over throughput; a graph launch also costs the host its
packing and unpacking (each filled buffer row gathered in, its output row copied out; padding rows are never
touched), on the accelerator's critical path. The backend measures the constants on the machine it runs on
(`Backend.measure_costs`); residency weighs a group's static cost (its padded (G, C, H) graph) against its experts'
expected cost on the CPU path, per layer: the accelerator's groups run beside the CPU's experts and spills, so a
layer takes the longer of the two.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


def expert_flops(tokens: float, hidden: int, ffn: int) -> float:
    """FLOPs of one gated expert FFN on `tokens` rows: gate_up 2·T·H·2I plus down 2·T·I·H."""
    return 6.0 * tokens * hidden * ffn


@dataclass(frozen=True)
class CostModel:
    launch_s: float  # static graph: fixed cost of one launch (dispatch and sync)
    static_flops: float  # static graph: throughput, FLOP/s
    cpu_call_s: float  # exact CPU path: fixed cost of one expert call
    cpu_flops: float  # exact CPU path: throughput, FLOP/s
    host_row_s: float = 0.0  # static graph: the host's packing of one buffer row and unpacking of its output

    def __post_init__(self) -> None:
        for name in ("launch_s", "static_flops", "cpu_call_s", "cpu_flops", "host_row_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value < 0 or value != value:
                raise ValueError(f"cost model {name} must be a non-negative number, got {value!r}")
        if self.static_flops == 0 or self.cpu_flops == 0:
            raise ValueError("cost model throughputs must be positive")

    def graph_seconds(self, n_experts: int, capacity: int, hidden: int, ffn: int) -> float:
        """One launch of a (G, C, H) group graph: padding slots cost as much as filled ones."""
        return self.launch_s + expert_flops(n_experts * capacity, hidden, ffn) / self.static_flops

    def host_seconds(self, filled_rows: float) -> float:
        """The host's packing of a launch's filled rows into its buffer and unpacking of their outputs."""
        return filled_rows * self.host_row_s

    def cpu_seconds(self, mean_loads: Sequence[float], hidden: int, ffn: int) -> float:
        """Expected exact-path cost of experts with these mean loads (an expert rarely hit costs
        about its hit rate in calls, approximated by min(1, mean load))."""
        return sum(min(1.0, load) * self.cpu_call_s + expert_flops(load, hidden, ffn) / self.cpu_flops
                   for load in mean_loads)

    def spill_seconds(self, mean_loads: Sequence[float], capacity: int, hidden: int, ffn: int) -> float:
        """Expected exact-path cost of a resident group's overflow: each expert's load beyond its capacity (at the
        mean load; a group whose capacity covers its mean spills only on busy chunks, which this leaves out)."""
        return self.cpu_seconds([max(0.0, load - capacity) for load in mean_loads], hidden, ffn)


def fit_call_cost(run: Callable[[int], None], small: int, large: int, flops: Callable[[int], float],
                  repeats: int = 10) -> tuple[float, float]:
    """(fixed seconds per call, FLOP/s) from timing `run(rows)` at two sizes, best of `repeats` (the best
    run is the one least disturbed by other work on the machine)."""
    run(small)  # warm up allocators and kernels
    run(large)
    t_small, t_large = (min(seconds_of(run, rows) for _ in range(repeats)) for rows in (small, large))
    throughput = (flops(large) - flops(small)) / max(t_large - t_small, 1e-9)
    fixed = max(t_small - flops(small) / throughput, 1e-7)
    return fixed, throughput


def seconds_of(run: Callable[[int], None], rows: int) -> float:
    start = time.perf_counter()
    run(rows)
    return time.perf_counter() - start
