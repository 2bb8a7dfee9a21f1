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

import torch

from . import host
from .int_linear import IsaKernel, PackedWeight, native_kernel
from .native import cpu_lacks, has_avx2


def linear(x: torch.Tensor, packed: PackedWeight, out: torch.Tensor | None = None, *,
           vnni: bool = False) -> torch.Tensor:
    """(m, K) float32 or bf16 rows times a weight packed by `vnni_linear.pack` -> (m, N) in x's dtype, into `out`
    when given (rows may be strided); int8 on AVX-VNNI with `vnni`."""
    return ISA.linear(x, packed, out, variant=vnni)


def silu_glu_expert(x: torch.Tensor, up: PackedWeight, down: PackedWeight, out: torch.Tensor | None = None, *,
                    vnni: bool = False) -> torch.Tensor:
    """(m, K) rows through a gated expert (IsaKernel.silu_glu_expert), weights packed by `vnni_linear.pack`; int8 on
    AVX-VNNI with `vnni`."""
    return ISA.silu_glu_expert(x, up, down, out, variant=vnni)


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


def unsupported_cpu() -> str | None:
    """Why this CPU cannot run the kernel whatever the compiler does, or None when it can."""
    return cpu_lacks("the AVX2 kernel", "x86-64", "AVX2 and FMA", has_avx2)


KERNEL = native_kernel("avx2_linear", "the AVX2 int8/int4 kernel", unsupported_cpu,
                       npumoe_avx2_has_vnni=())
ISA = IsaKernel("AVX2", KERNEL, "AVX-VNNI", vnni_unavailable)
