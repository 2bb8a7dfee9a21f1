"""The roofline of one MoE layer's prefill on this machine: the time no expert implementation can beat.

Two floors, both measured here rather than taken from a datasheet:
- compute: the layer's active FLOPs (2·T·k·3·H·I: gate, up and down projections of every routed
  token) run as one dense matmul of the same FLOPs at the same dtype, the best shape the BLAS gets;
- memory: the bytes of the expert weights the routing touches, read once at the measured bandwidth.
The roofline time is the larger of the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .timing import median_seconds

MODEL = ("roofline = max(active FLOPs 2·T·k·3·H·I timed as one dense (T·k, H) x (H, 3I) matmul, "
         "touched expert-weight bytes / measured copy bandwidth)")


@dataclass(frozen=True)
class Roofline:
    flops: int
    weight_bytes: int
    compute_s: float
    memory_s: float

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.memory_s)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


def active_flops(tokens: int, top_k: int, hidden: int, ffn: int) -> int:
    """FLOPs of T tokens through k gated expert FFNs each: (H -> 2I) then (I -> H), 2 FLOPs a multiply-add."""
    return 2 * tokens * top_k * 3 * hidden * ffn


def moe_roofline(*, tokens: int, top_k: int, hidden: int, ffn: int, experts_touched: int, dtype: torch.dtype,
                 bandwidth: float, warmup: int = 2, repeats: int = 5) -> Roofline:
    """Measure the compute floor at `dtype` and derive the memory floor from `bandwidth` (bytes/s)."""
    if min(tokens, top_k, hidden, ffn) < 1 or experts_touched < 0 or bandwidth <= 0:
        raise ValueError(f"roofline needs positive sizes and bandwidth, got tokens={tokens}, top_k={top_k}, "
                         f"hidden={hidden}, ffn={ffn}, experts_touched={experts_touched}, bandwidth={bandwidth}")
    x = torch.randn(tokens * top_k, hidden).to(dtype)  # every routed (token, expert) row
    w = torch.randn(3 * ffn, hidden).to(dtype)  # gate, up and down of one expert, as one (3I, H) weight
    compute_s = median_seconds(lambda: F.linear(x, w), warmup=warmup, repeats=repeats)
    weight_bytes = experts_touched * 3 * hidden * ffn * w.element_size()
    return Roofline(flops=active_flops(tokens, top_k, hidden, ffn), weight_bytes=weight_bytes,
                    compute_s=compute_s, memory_s=weight_bytes / bandwidth)
