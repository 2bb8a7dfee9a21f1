"""The engine's own int8 and int4 matmuls for x86-64 CPUs with AVX2 and FMA, built from avx2_linear.c at first use.

Why: on x86 without AVX512-VNNI (AMD's Zen 3 and before, Intel's client cores before Alder Lake, an Intel Mac)
vnni_linear cannot run, and the library int8 matmuls there add pairs of byte products in int16, which saturates
on the whole int8 range (quant_kernels' probe refuses them); torch's int4 matmul widens the weights to float. This
kernel multiplies bytes with AVX2's VPMADDUBSW arranged so that no pair sum can saturate (avx2_linear.c says how)
and reads the weights as vnni_linear packs them (`vnni_linear.pack`), so both kernels share one packing, one
rounding of x (per row to int8, a second level of codes for rows with outliers in int8) and one contract:
`linear` and `silu_glu_expert`, on the caller's thread. Where the CPU has AVX-VNNI (Intel's client cores from Alder
Lake, which have no AVX-512; AMD's from Zen 5), int8 can run its byte products on VPDPBUSD instead (`vnni=True`,
after `vnni_unavailable()` says None): x's codes + 128 times the weights, less 128 times each column's sum of codes,
one instruction where AVX2 takes four (1.4 to 1.7 times the AVX2 tiles' rate on a Zen 5, one thread).

It is built and loaded by native.py. Where the CPU is not x86-64 with AVX2 and FMA, `unavailable()` says why.
"""

from __future__ import annotations

import ctypes
import platform

import torch

from ..formats.quantize import INT4
from . import host
from .native import NativeKernel
from .vnni_linear import PackedWeight, check_expert, check_rows, native_weight


def linear(x: torch.Tensor, packed: PackedWeight, out: torch.Tensor | None = None, *,
           vnni: bool = False) -> torch.Tensor:
    """(m, K) float32 or bf16 rows times a weight packed by `vnni_linear.pack` -> (m, N) in x's dtype, into `out`
    when given (rows may be strided); int8 on AVX-VNNI with `vnni`."""
    m, k = x.shape
    n = packed.shape[0]
    if out is None:
        out = x.new_empty(m, n)
    check_rows(f"AVX2 {packed.format} linear", x, out, packed.shape)
    if not m:
        return out
    bf16 = int(x.dtype == torch.bfloat16)
    library = _library(packed.format, vnni)
    if packed.format == INT4:
        failed = library.npumoe_avx2_linear_int4(x.data_ptr(), m, x.stride(0), bf16, packed.codes.data_ptr(),
                                                 packed.scale.data_ptr(), packed.zero.data_ptr(), packed.group, n, k,
                                                 out.data_ptr(), out.stride(0))
    else:
        failed = library.npumoe_avx2_linear_int8(x.data_ptr(), m, x.stride(0), bf16, packed.codes.data_ptr(),
                                                 packed.sums.data_ptr(), packed.scale.data_ptr(), n, k,
                                                 out.data_ptr(), out.stride(0), int(vnni))
    if failed:
        raise MemoryError(f"the AVX2 {packed.format} kernel could not allocate {m} rows of scratch")
    return out


def silu_glu_expert(x: torch.Tensor, up: PackedWeight, down: PackedWeight, out: torch.Tensor | None = None, *,
                    vnni: bool = False) -> torch.Tensor:
    """(m, K) rows through a gated expert, silu(gate)·up times `down`, with up = [gate; up] packed (2I, K) and down
    packed (N, I) in one format -> (m, N) in x's dtype, into `out` when given, in one native call; int8 on
    AVX-VNNI with `vnni`."""
    check_expert(x, up, down)
    m, k = x.shape
    n = down.shape[0]
    if out is None:
        out = x.new_empty(m, n)
    check_rows(f"AVX2 {up.format} expert", x, out, (n, k))
    if not m:
        return out
    failed = _library(up.format, vnni).npumoe_avx2_silu_glu_expert(
        x.data_ptr(), m, x.stride(0), int(x.dtype == torch.bfloat16), int(up.format == INT4), int(vnni),
        ctypes.byref(native_weight(up)), ctypes.byref(native_weight(down)), out.data_ptr(), out.stride(0))
    if failed:
        raise MemoryError(f"the AVX2 {up.format} expert could not allocate {m} rows of scratch")
    return out


def unavailable() -> str | None:
    """Why this machine cannot run the kernel, or None when it can."""
    return KERNEL.unavailable()


def vnni_unavailable() -> str | None:
    """Why int8 cannot run on AVX-VNNI's dot products here, or None when it can."""
    if (why := unavailable()) is not None:
        return why
    if "avx_vnni" not in host.cpu_flags():
        return "this CPU lacks AVX-VNNI"
    if (why := host.isa_ceiling_refuses("avx2_vnni")) is not None:
        return why
    if not KERNEL.library().npumoe_avx2_has_vnni():
        return "the C compiler that built the kernel has no AVX-VNNI (GCC 11 and clang 12 have)"
    return None


def _library(format: str, vnni: bool) -> ctypes.CDLL:
    if vnni:
        why = "it takes int8 weights" if format == INT4 else vnni_unavailable()
        if why is not None:
            raise ValueError(f"the AVX-VNNI kernel cannot run this: {why}")
    return KERNEL.library()


def unsupported_cpu() -> str | None:
    """Why this CPU cannot run the kernel whatever the compiler does, or None when it can (torch's AVX2 level
    means AVX2 and FMA; AVX-512 CPUs have both)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the AVX2 kernel is for x86-64 CPUs, this is {platform.machine()}"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return "this CPU lacks AVX2 and FMA"
    return None


_POINTER, _SIZE, _FLAG = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
KERNEL = NativeKernel(
    "avx2_linear", "the AVX2 int8/int4 kernel",
    {"npumoe_avx2_linear_int8": (_POINTER, _SIZE, _SIZE, _FLAG, _POINTER, _POINTER, _POINTER, _SIZE, _SIZE, _POINTER,
                                 _SIZE, _FLAG),
     "npumoe_avx2_linear_int4": (_POINTER, _SIZE, _SIZE, _FLAG, _POINTER, _POINTER, _POINTER, _SIZE, _SIZE, _SIZE,
                                 _POINTER, _SIZE),
     "npumoe_avx2_silu_glu_expert": (_POINTER, _SIZE, _SIZE, _FLAG, _FLAG, _FLAG, _POINTER, _POINTER, _POINTER,
                                     _SIZE),
     "npumoe_avx2_has_vnni": ()},
    unsupported_cpu, restype=ctypes.c_int)
