"""The engine's own RMSNorm of rows, built from norm_kernel.c at first use.

Why its own: transformers' RMSNorm modules run about five torch operations (widen, square, mean, scale, weight,
narrow), each a pass over the activations with an operator dispatch of its own, many times what reading and
writing the rows once costs. The kernel reads each row once and rounds where the module does
(`CAST_FIRST`, `WEIGHT_FIRST`: see norm_kernel.c), so it equals the module up to the order of the sum of squares.

It runs on the caller's thread. Built and loaded by native.py; where the CPU is not x86-64 with AVX-512 or no
compiler builds it, `unavailable()` says why.
"""

from __future__ import annotations

import ctypes

import torch

from .native import NativeKernel, x86_avx512_missing

DTYPES = (torch.float32, torch.bfloat16)
CAST_FIRST, WEIGHT_FIRST = 0, 1  # where the module rounds to the input dtype: before the weight, or after it


def unsupported_cpu() -> str | None:
    """Why this CPU cannot run the kernel whatever the compiler does, or None when it can."""
    return x86_avx512_missing("the norm kernel")


def unavailable() -> str | None:
    """Why this machine cannot run the kernel, or None when it can."""
    return KERNEL.unavailable()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, mode: int, out: torch.Tensor, *,
             native_bf16: bool | None = None) -> torch.Tensor:
    """(m, n) rows of x normalised and scaled by the (n,) float32 `weight`, rounded as `mode` says, into `out`
    (m, n) of x's dtype; rows of x and out may be strided, their elements must be adjacent. bf16 is rounded by
    AVX512-BF16's conversion where the CPU has it (`native_bf16` None), else on the integer bits; both are
    round-to-nearest-even."""
    m, n = x.shape
    if (x.dtype not in DTYPES or out.dtype != x.dtype or out.shape != x.shape or weight.dtype != torch.float32
            or weight.shape != (n,) or not weight.is_contiguous() or x.stride(1) != 1 or out.stride(1) != 1
            or mode not in (CAST_FIRST, WEIGHT_FIRST)):
        raise ValueError(f"rms norm: x {x.dtype} {tuple(x.shape)} (strides {x.stride()}), weight {weight.dtype} "
                         f"{tuple(weight.shape)}, out {out.dtype} {tuple(out.shape)}, mode {mode}: need float32 or "
                         "bfloat16 rows of unit-stride elements, a contiguous float32 weight of their width")
    has_bf16 = torch.cpu._is_avx512_bf16_supported()
    if native_bf16 and not has_bf16:
        raise ValueError("this CPU lacks AVX512-BF16: bf16 can only be rounded on the integer bits here")
    if m:
        if x.dtype == torch.float32:
            name = "npumoe_rms_norm_f32"
        elif has_bf16 if native_bf16 is None else native_bf16:
            name = "npumoe_rms_norm_bf16_native"
        else:
            name = "npumoe_rms_norm_bf16"
        getattr(KERNEL.library(), name)(x.data_ptr(), m, x.stride(0), n, weight.data_ptr(), eps, mode,
                                        out.data_ptr(), out.stride(0))
    return out


_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64
_ARGUMENTS = (_POINTER, _SIZE, _SIZE, _SIZE, _POINTER, ctypes.c_float, ctypes.c_int32, _POINTER, _SIZE)
KERNEL = NativeKernel("norm_kernel", "the norm kernel",
                      {name: _ARGUMENTS for name in ("npumoe_rms_norm_f32", "npumoe_rms_norm_bf16",
                                                     "npumoe_rms_norm_bf16_native")}, unsupported_cpu)
SOURCE = KERNEL.source
