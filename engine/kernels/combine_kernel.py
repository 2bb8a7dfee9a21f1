"""The engine's own combine of expert outputs, built from combine_kernel.c at first use.

Why its own: torch's combine gathers every assignment's row into token order (an (S, H) copy), widens the
whole gathered buffer to float32 and runs T tiny (1, k) x (k, H) matmuls, each with a dispatch of its own (S is
top-k times the chunk's tokens: 4,096 rows of 2,048 for a 512-token chunk of Qwen3-30B-A3B). The kernel
reads each output row where the experts wrote it, sums in float32 and rounds once: the same result up to
summation order. Tokens are split over the engine's workers.

Plain C (no CPU feature assumed; AVX2 and AVX-512 versions beside it on x86-64 with glibc, picked at load): it
runs wherever native.py can build it; where it cannot (no compiler), `unavailable()` says why and the dispatcher
combines with torch (dispatch.combine).
"""

from __future__ import annotations

import ctypes
from itertools import pairwise

import torch

from .native import NativeKernel
from .workers import run_tasks

DTYPES = (torch.float32, torch.bfloat16)  # of the expert outputs; the router weights are taken as float32
_MIN_TOKENS_PER_TASK = 16  # fewer rows than this are not worth a worker's wake-up


def supports(out: torch.Tensor, top_k_weights: torch.Tensor) -> bool:
    """Whether the kernel can combine these: contiguous outputs of a dtype it reads, weights at most float32
    (a finer dtype would be rounded by taking them as float32)."""
    return (out.device.type == "cpu" and out.dtype in DTYPES and out.is_contiguous()
            and top_k_weights.dtype in DTYPES and KERNEL.unavailable() is None)


def combine(out: torch.Tensor, at: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """(S, H) expert outputs, at (S,) int64 the row of `out` holding each assignment t·k + j, (T, k) router
    weights -> (T, H) in out's dtype: each token's weighted sum, in float32, rounded once."""
    T, k = top_k_weights.shape
    H = out.shape[1]
    if at.shape != (T * k,) or at.dtype != torch.int64:
        raise ValueError(f"combine needs {T * k} int64 row indices, got {at.dtype} {tuple(at.shape)}")
    at = at.contiguous()
    weights = top_k_weights.to(torch.float32).contiguous()
    y = out.new_empty(T, H)
    library = KERNEL.library()
    bf16 = int(out.dtype == torch.bfloat16)
    failed: list[int] = []

    def task(first: int, last: int) -> None:
        if library.npumoe_combine(out.data_ptr(), H, bf16, at.data_ptr(), weights.data_ptr(), k, first, last,
                                  y.data_ptr()):
            failed.append(first)

    tasks = max(1, min(torch.get_num_threads(), T // _MIN_TOKENS_PER_TASK))
    bounds = [T * i // tasks for i in range(tasks + 1)]
    run_tasks([lambda lo=lo, hi=hi: task(lo, hi) for lo, hi in pairwise(bounds) if hi > lo])
    if failed:
        raise MemoryError(f"the combine kernel could not allocate a row of {H} floats")
    return y


def unavailable() -> str | None:
    """Why this machine cannot run the kernel, or None when it can."""
    return KERNEL.unavailable()


_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64
KERNEL = NativeKernel("combine_kernel", "the combine kernel",
                      {"npumoe_combine": (_POINTER, _SIZE, ctypes.c_int, _POINTER, _POINTER, _SIZE, _SIZE, _SIZE,
                                          _POINTER)},
                      lambda: None, restype=ctypes.c_int)
