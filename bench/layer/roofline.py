"""The roofline of one MoE layer's prefill on this machine: the time no expert implementation can beat.

Two floors, both measured here rather than taken from a datasheet:
- compute: the layer's active FLOPs (2·T·k·3·H·I: gate, up and down projections of every routed
  token) run as one dense matmul of the same FLOPs at the same dtype, the best shape a matmul gets,
  timed on every kernel the experts can run here (torch's, oneDNN's, the engine's own) and the fastest kept;
- memory: the bytes of the expert weights the routing touches, read once at the measured bandwidth; for quantized
  experts, the bytes of their format (codes, scales and zeros: formats/quantize.py), not the float weights'.
The roofline time is the larger of the two.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from npumoe.engine.formats.quantize import quantize
from npumoe.engine.kernels.float_kernels import KERNELS, PackedLinear, unavailable_kernels
from npumoe.engine.kernels.workers import run_tasks

from ..timing import interleaved_median_seconds

MODEL = ("roofline = max(active FLOPs 2·T·k·3·H·I timed as one dense (T·k, H) x (H, 3I) matmul on the fastest "
         "kernel here, "
         "touched expert-weight bytes (a quantized path's: its format's) / measured copy bandwidth)")


@dataclass(frozen=True)
class Roofline:
    flops: int
    weight_bytes: int
    compute_s: float
    memory_s: float
    compute_kernel: str  # the kernel that ran the dense matmul fastest

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
                 bandwidth: float, compute_times: Mapping[str, float] | None = None, warmup: int = 2,
                 repeats: int = 5, weights_format: str | None = None) -> Roofline:
    """The compute floor at `dtype` and the memory floor at `bandwidth` (bytes/s), the experts' weights priced in
    `weights_format` (None: `dtype`; a quantized path's compute floor stays the float matmul's).

    `compute_times`: seconds of each of `dense_matmuls(...)`, where the caller timed them beside what it
    compares with the roofline; otherwise they are timed here.
    """
    if min(tokens, top_k, hidden, ffn) < 1 or experts_touched < 0 or bandwidth <= 0:
        raise ValueError(f"roofline needs positive sizes and bandwidth, got tokens={tokens}, top_k={top_k}, "
                         f"hidden={hidden}, ffn={ffn}, experts_touched={experts_touched}, bandwidth={bandwidth}")
    if compute_times is None:
        compute_times = interleaved_median_seconds(dense_matmuls(tokens=tokens, top_k=top_k, hidden=hidden,
                                                                 ffn=ffn, dtype=dtype),
                                                   warmup=warmup, repeats=repeats)
    compute_kernel = min(compute_times, key=compute_times.__getitem__)
    weight_bytes = experts_touched * expert_bytes(hidden, ffn, dtype, weights_format)
    return Roofline(flops=active_flops(tokens, top_k, hidden, ffn), weight_bytes=weight_bytes,
                    compute_s=compute_times[compute_kernel], memory_s=weight_bytes / bandwidth,
                    compute_kernel=compute_kernel)


def expert_bytes(hidden: int, ffn: int, dtype: torch.dtype, weights_format: str | None = None) -> int:
    """Bytes of one gated expert's three matrices in `weights_format` (None: float `dtype`): for a quantized
    format, what quantize() makes of its gate-and-up (2I, H) and down (H, I) weights, scales and zeros included."""
    if weights_format is None:
        return 3 * hidden * ffn * dtype.itemsize
    return sum(quantize(torch.zeros(rows, columns), weights_format).nbytes
               for rows, columns in ((2 * ffn, hidden), (hidden, ffn)))


def dense_matmuls(*, tokens: int, top_k: int, hidden: int, ffn: int,
                  dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    """The roofline's dense matmul, every routed (token, expert) row times one (3I, H) weight holding an
    expert's gate, up and down, on each kernel here, every one using all of torch's threads."""
    x = torch.randn(tokens * top_k, hidden).to(dtype)
    w = torch.randn(3 * ffn, hidden).to(dtype)
    matmuls: dict[str, Callable[[], object]] = {"torch": lambda: F.linear(x, w)}
    parts = x.chunk(torch.get_num_threads())
    unavailable = unavailable_kernels(w)
    for kernel in (k for k in KERNELS if k != "torch" and k not in unavailable):
        # the experts' packed kernels, the rows shared out to the workers as experts are
        packed = PackedLinear(w, kernel)
        matmuls[kernel] = lambda packed=packed: run_tasks([lambda part=part: packed(part) for part in parts])
    return matmuls
