"""The engine's own bf16 matmul for x86-64 CPUs with AVX512-BF16, built from bf16_linear.c at first use.

Why its own: an expert in prefill sees a few to a few dozen rows, so its matmuls are bound by reading
the expert's weights, and a plain in-order stream over a weight packed for it reads them faster than oneDNN's
small-batch kernels do; at hundreds of rows the two are level. Whether it wins is measured on each machine
(float_kernels); `npumoed bench moe` compares the paths (bench/results/).

It is built and loaded by native.py (the user's kernel cache, checked before loading). Where there is no
compiler, no x86-64 CPU or no AVX512-BF16, `unavailable()` says why and the experts choose among the other
kernels (float_kernels).
"""

from __future__ import annotations

import ctypes

import torch

from .native import NativeKernel, cpu_lacks

BLOCK = 64  # output columns per packed weight block, as in bf16_linear.c


def supports(out_features: int, in_features: int) -> bool:
    """Whether a (out_features, in_features) weight packs into whole blocks of K pairs."""
    return out_features % BLOCK == 0 and in_features % 2 == 0 and min(out_features, in_features) > 0


def pack(w: torch.Tensor) -> torch.Tensor:
    """(N, K) bf16 -> (N/64, K/2, 64, 2): each block of 64 output columns one in-order stream of K pairs."""
    n, k = w.shape
    if w.dtype != torch.bfloat16 or not supports(n, k):
        raise ValueError(f"need a bf16 weight with N % {BLOCK} == 0 and K even, got {w.dtype} {tuple(w.shape)}")
    return w.reshape(n // BLOCK, BLOCK, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(m, K) bf16 rows times a packed (N, K) weight -> (m, N), into `out` when given (rows may be strided)."""
    m, k = x.shape
    n = packed.shape[0] * BLOCK
    if out is None:
        out = x.new_empty(m, n)
    if (x.dtype != torch.bfloat16 or out.dtype != torch.bfloat16 or k != packed.shape[1] * 2 or out.shape != (m, n)
            or x.stride(1) != 1 or out.stride(1) != 1 or not packed.is_contiguous()):
        raise ValueError(f"bf16 linear: x {x.dtype} {tuple(x.shape)}, weight ({n}, {packed.shape[1] * 2}), out "
                         f"{out.dtype} {tuple(out.shape)}; rows must be unit-stride")
    if m:
        KERNEL.library().npumoe_linear_bf16(x.data_ptr(), m, x.stride(0), packed.data_ptr(), n, k,
                                            out.data_ptr(), out.stride(0))
    return out


def unavailable() -> str | None:
    """Why this machine cannot run the kernel, or None when it can."""
    return KERNEL.unavailable()


def unsupported_cpu() -> str | None:
    """Why this CPU cannot run the kernel whatever the compiler does, or None when it can."""
    return cpu_lacks("the bf16 kernel", "x86-64", "AVX512-BF16", torch.cpu._is_avx512_bf16_supported, "avx512_bf16")


_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64
KERNEL = NativeKernel("bf16_linear", "the bf16 kernel",
                      {"npumoe_linear_bf16": (_POINTER, _SIZE, _SIZE, _POINTER, _SIZE, _SIZE, _POINTER, _SIZE)},
                      unsupported_cpu)
SOURCE = KERNEL.source
