"""The engine's own int8 matmul for arm64 CPUs with the dot-product instructions, built from neon_linear.c at first
use: vnni_linear's contract (`pack`, `linear`, `silu_glu_expert`) on Arm, which runs it either with SDOT
(asimddp: every Armv8.2-A core on, Apple's M1 included) or with SMMLA (i8mm: Apple M2 on, Graviton 3, Neoverse V1/N2),
both over the same packed weights; quant_kernels offers each as a candidate and the choice measures them.

Activations are rounded per row to int8 (absmax / 127), with vnni_linear's second level of codes for rows with
outliers, so results are the dequantized reference's up to that rounding. Weights of any shape are padded to whole
blocks of 16 outputs and octets of 8 inputs (the padding's codes and scale are 0). Where the CPU is not arm64 with
asimddp, `unavailable()` says why and quant_kernels chooses among the other kernels.
"""

from __future__ import annotations

import ctypes
import platform

import torch
import torch.nn.functional as F

from ..formats.quantize import INT8, QuantizedWeight
from . import host
from .native import NativeKernel
from .vnni_linear import PackedWeight

BLOCK = 16  # output columns per packed weight block, as in neon_linear.c
OCTET = 8  # inputs per SMMLA operand row
# int32 sums of products of two codes of at most 127 each: K up to 2^31 / 127² = 133,144 inputs cannot overflow
MAX_IN_FEATURES = 131072


def unsupported(weight: QuantizedWeight) -> str | None:
    """Why the kernel cannot take this weight, or None."""
    if weight.format != INT8:
        return f"the NEON kernel takes int8 weights, not {weight.format}"
    if weight.shape[1] > MAX_IN_FEATURES:
        return f"its int32 sums need inputs of at most {MAX_IN_FEATURES}, not {weight.shape[1]}"
    return None


def pack(weight: QuantizedWeight) -> PackedWeight:
    """The weight in the kernel's layout (neon_linear.c): codes (N16/16, K8/8, 8, 2, 8) int8 (per block, octet of
    inputs, pair of columns: each column's 8 codes), scale (N16,) float32."""
    if (why := unsupported(weight)) is not None:
        raise ValueError(f"the NEON kernel cannot take this {weight.format} weight {weight.shape}: {why}")
    n, k = weight.shape
    codes = F.pad(weight.codes, (0, -k % OCTET, 0, -n % BLOCK))
    blocks, octets = codes.shape[0] // BLOCK, codes.shape[1] // OCTET
    # (block, pair, column of the pair, octet, 8) -> (block, octet, pair, column of the pair, 8)
    packed = codes.reshape(blocks, BLOCK // 2, 2, octets, OCTET).permute(0, 3, 1, 2, 4).contiguous()
    return PackedWeight(INT8, (n, k), packed, F.pad(weight.scale.float(), (0, -n % BLOCK)).contiguous())


def linear(x: torch.Tensor, packed: PackedWeight, out: torch.Tensor | None = None, *,
           i8mm: bool = False) -> torch.Tensor:
    """(m, K) float32 or bf16 rows times a packed (N, K) weight -> (m, N) in x's dtype, into `out` when given (rows
    may be strided); SMMLA with `i8mm`, else SDOT."""
    m = x.shape[0]
    n, k = packed.shape
    out = _checked("linear", x, out, packed.shape)
    if m and _library(i8mm).npumoe_neon_linear_int8(x.data_ptr(), m, x.stride(0), int(x.dtype == torch.bfloat16),
                                                    packed.codes.data_ptr(), packed.scale.data_ptr(), n, k,
                                                    out.data_ptr(), out.stride(0), int(i8mm)):
        raise MemoryError(f"the NEON int8 kernel could not allocate {m} rows of scratch")
    return out


def silu_glu_expert(x: torch.Tensor, up: PackedWeight, down: PackedWeight, out: torch.Tensor | None = None, *,
                    i8mm: bool = False) -> torch.Tensor:
    """(m, K) rows through a gated expert, silu(gate)·up times `down`, with up = [gate; up] packed (2I, K) and down
    packed (N, I) -> (m, N) in x's dtype, into `out` when given; SMMLA with `i8mm`, else SDOT."""
    m, k = x.shape
    n, inter = down.shape
    if up.shape != (2 * inter, k):
        raise ValueError(f"a gated expert needs gate-up (2I, K) and down (N, I) weights, got {up.shape} and "
                         f"{down.shape} for rows of width {k}")
    out = _checked("expert", x, out, (n, k))
    if m and _library(i8mm).npumoe_neon_silu_glu_expert(
            x.data_ptr(), m, x.stride(0), int(x.dtype == torch.bfloat16), up.codes.data_ptr(), up.scale.data_ptr(), k,
            down.codes.data_ptr(), down.scale.data_ptr(), n, inter, out.data_ptr(), out.stride(0), int(i8mm)):
        raise MemoryError(f"the NEON int8 expert could not allocate {m} rows of scratch")
    return out


def _checked(what: str, x: torch.Tensor, out: torch.Tensor | None, shape: tuple[int, int]) -> torch.Tensor:
    """`out`, or a new (m, N) tensor, once x and it are (m, K) and (m, N) float32 or bf16 unit-stride rows."""
    if out is None:
        out = x.new_empty(x.shape[0], shape[0])
    if (x.ndim != 2 or x.dtype not in (torch.float32, torch.bfloat16) or out.dtype != x.dtype or x.shape[1] != shape[1]
            or out.shape != (x.shape[0], shape[0]) or x.stride(1) != 1 or out.stride(1) != 1):
        raise ValueError(f"NEON int8 {what}: x {x.dtype} {tuple(x.shape)}, weight {shape}, out {out.dtype} "
                         f"{tuple(out.shape)}; float32 or bf16 rows, unit-stride")
    return out


def _library(i8mm: bool) -> ctypes.CDLL:
    why = i8mm_unavailable() if i8mm else unavailable()
    if why is not None:
        raise ValueError(f"the NEON int8 kernel cannot run here: {why}")
    return KERNEL.library()


def unavailable() -> str | None:
    """Why this machine cannot run the kernel with SDOT, or None when it can."""
    return KERNEL.unavailable()


def i8mm_unavailable() -> str | None:
    """Why this machine cannot run the kernel with SMMLA, or None when it can."""
    if (why := unavailable()) is not None:
        return why
    return None if "i8mm" in host.arm_features() else "this CPU lacks the int8 matrix multiply instructions (i8mm)"


def unsupported_cpu() -> str | None:
    """Why this CPU cannot run the kernel whatever the compiler does, or None when it can."""
    if platform.machine().lower() not in ("arm64", "aarch64"):
        return f"the NEON kernel is for arm64 CPUs, this is {platform.machine()}"
    if "asimddp" not in host.arm_features():
        return "this CPU lacks the dot-product instructions (asimddp)"
    return None


_POINTER, _SIZE, _FLAG = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
KERNEL = NativeKernel(
    "neon_linear", "the NEON int8 kernel",
    {"npumoe_neon_linear_int8": (_POINTER, _SIZE, _SIZE, _FLAG, _POINTER, _POINTER, _SIZE, _SIZE, _POINTER, _SIZE,
                                 _FLAG),
     "npumoe_neon_silu_glu_expert": (_POINTER, _SIZE, _SIZE, _FLAG, _POINTER, _POINTER, _SIZE, _POINTER, _POINTER,
                                     _SIZE, _SIZE, _POINTER, _SIZE, _FLAG)},
    unsupported_cpu, restype=ctypes.c_int)
