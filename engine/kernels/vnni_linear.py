"""The engine's own int8 and int4 matmuls for x86-64 CPUs with AVX512-VNNI, built from vnni_linear.c at first use.

Why its own: torch's quantized kernels cannot beat the float kernels at the row counts an expert sees in prefill.
oneDNN's dynamic int8 matmul needs x rounded by half a dozen separate torch ops first, and torch's int4 matmul
widens the weights to float; this kernel rounds x inside the call and multiplies bytes with VNNI dot products,
reading weights packed as one in-order stream per block of 64 output columns (int8's in runs that are AMX tiles).

Activations are rounded per row to int8 (absmax / 127, as quant_kernels.quantize_rows), so results are the
dequantized reference's up to that rounding; for int8, a row with outlier features that this rounds by more than
the kernel's threshold (relative L2, in vnni_linear.c) takes a second row of codes for what the first missed
(below). Weights of any output width are padded to whole blocks (and int8's inputs to whole 64s); int4 needs groups
of a multiple of 16 along K. int8 also runs on AMX-INT8 tiles where the CPU has them (`linear(..., amx=True)`,
after `amx_unavailable()` says None), over the same packed weights.
`silu_glu_expert` runs a whole gated expert (gate-up, silu(gate)·up, down) in one call, its intermediate values in
float32 and never leaving the kernel. The second level of codes keeps rows with outlier features: the outliers of
trained models (a few channels tens of times the rest) then cost an int8 expert about what plain rows do, where
one level would round them several times worse (tests/engine/test_vnni_linear.py checks both kernels on such
rows). Only such rows pay for the second level's arithmetic.

It is built and loaded by native.py. Where the CPU is not x86-64 with AVX512-VNNI, `unavailable()` says why and
quant_kernels chooses among its other kernels: on AVX2, avx2_linear reads this module's packing (`pack`) through the
same wrapper (int_linear.IsaKernel); on arm64 its sibling neon_linear (SDOT / SMMLA) keeps the same
`pack`/`linear`/`silu_glu_expert` contract with a packing of its own.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch
import torch.nn.functional as F

from ..formats.quantize import INT4, INT8, QuantizedWeight
from .host import isa_ceiling_refuses
from .int_linear import IsaKernel, PackedWeight, block_zeros, native_kernel
from .native import cpu_lacks

BLOCK = 64  # output columns per packed weight block, as in vnni_linear.c
INT4_GROUP_MULTIPLE = 16  # the kernel sums x codes per group 16 at a time
# int32 sums of (x + 128) · w: 255 · 127 a product, so K up to 2^31 / 32385 inputs cannot overflow
MAX_IN_FEATURES = 65536


def unsupported(weight: QuantizedWeight) -> str | None:
    """Why the kernel cannot take this weight, or None."""
    k = weight.shape[1]
    if k > MAX_IN_FEATURES:
        return f"its int32 sums need inputs of at most {MAX_IN_FEATURES}, not {k}"
    if weight.format == INT4 and weight.group % INT4_GROUP_MULTIPLE:
        return f"it needs int4 groups that are a multiple of {INT4_GROUP_MULTIPLE}, not {weight.group}"
    return None


def pack(weight: QuantizedWeight) -> PackedWeight:
    """The weight in the kernel's layout (see vnni_linear.c), padded to whole blocks of 64 outputs (the padding's
    scale is 0):
    int8: codes (N64/64, K64/64, 4, 16, 16, 4) int8 (per block of 64 columns and chunk of 64 inputs, four runs of 16
    columns, each 16 quads of inputs x 16 columns x 4: an AMX tile), sums (N64,) int32 (Σ_k of each column's codes),
    scale (N64,) float32;
    int4: codes (N64/64, K/8, 64, 4) uint8 nibble pairs, scale and zero (N64/64, K/group, 64) bfloat16."""
    if (why := unsupported(weight)) is not None:
        raise ValueError(f"the VNNI kernel cannot take this {weight.format} weight {weight.shape}: {why}")
    n, k = weight.shape
    pad_n = -n % BLOCK
    if weight.format == INT8:
        codes = F.pad(weight.codes, (0, -k % 64, 0, pad_n))  # whole AMX tiles of 64 inputs
        blocks, chunks = codes.shape[0] // BLOCK, codes.shape[1] // 64
        # (block, column run, column, chunk, quad) -> (block, chunk, column run, quad, column), each quad of inputs
        # moved as one int32 (torch's copy of 4-byte runs measured 4 times slower)
        packed = codes.view(torch.int32).reshape(blocks, 4, 16, chunks, 16).permute(0, 3, 1, 4, 2).contiguous()
        packed = packed.view(torch.int8).reshape(blocks, chunks, 4, 16, 16, 4)
        sums = torch.from_numpy(codes.numpy().sum(axis=1, dtype=np.int32))  # numpy's: 6 times torch's on one thread
        return PackedWeight(INT8, (n, k), packed, F.pad(weight.scale.float(), (0, pad_n)).contiguous(), sums=sums)
    # each octet of inputs is 4 bytes: the engine's nibbles hold its codes 0..7 in order, the kernel's 0, 4, 1, 5, 2,
    # 6, 3, 7 (byte i: codes i and 4 + i); worked two octets a word, then (N, K/8) octets into blocks
    octets = torch.from_numpy(_interleaved(weight.codes.contiguous().numpy().view(np.uint64)).view(np.int32))
    octets = F.pad(octets, (0, 0, 0, pad_n))
    blocks = octets.shape[0] // BLOCK
    nibbles = octets.reshape(blocks, BLOCK, k // 8).transpose(1, 2).contiguous()
    nibbles = nibbles.view(torch.uint8).reshape(blocks, k // 8, BLOCK, 4)

    def per_block(t: torch.Tensor) -> torch.Tensor:  # (N, G) -> (N64/64, G, 64)
        return F.pad(t.to(torch.bfloat16), (0, 0, 0, pad_n)).reshape(blocks, BLOCK, -1).transpose(1, 2).contiguous()

    zero = block_zeros(weight.zero, per_block, (blocks, weight.zero.shape[1], BLOCK))
    return PackedWeight(INT4, (n, k), nibbles, per_block(weight.scale), zero=zero, group=weight.group)


def _interleaved(words: np.ndarray) -> np.ndarray:
    """Each 4 bytes' eight nibbles a0 a1 a2 a3 b0 b1 b2 b3 (least significant first) as a0 b0 a1 b1 a2 b2 a3 b3, in
    uint64 words of two (x86 is little-endian): the middle two bytes swapped, then the middle two nibbles of each
    2 bytes. numpy: torch's integer bit operations measured 3-4 times slower on one thread."""
    words = (words & 0xFF0000FFFF0000FF) | ((words & 0x00FF000000FF0000) >> 8) | ((words & 0x0000FF000000FF00) << 8)
    return (words & 0xF00FF00FF00FF00F) | ((words & 0x0F000F000F000F00) >> 4) | ((words & 0x00F000F000F000F0) << 4)


def linear(x: torch.Tensor, packed: PackedWeight, out: torch.Tensor | None = None, *,
           amx: bool = False) -> torch.Tensor:
    """(m, K) float32 or bf16 rows times a packed (N, K) weight -> (m, N) in x's dtype, into `out` when given (rows
    may be strided); int8 on AMX tiles with `amx`."""
    return ISA.linear(x, packed, out, variant=amx)


def silu_glu_expert(x: torch.Tensor, up: PackedWeight, down: PackedWeight, out: torch.Tensor | None = None, *,
                    amx: bool = False) -> torch.Tensor:
    """(m, K) rows through a gated expert (IsaKernel.silu_glu_expert); int8 on AMX tiles with `amx`."""
    return ISA.silu_glu_expert(x, up, down, out, variant=amx)


def unavailable() -> str | None:
    """Why this machine cannot run the kernel, or None when it can."""
    return KERNEL.unavailable()


def amx_unavailable() -> str | None:
    """Why int8 cannot run on AMX tiles here, or None when it can."""
    if (why := unavailable()) is not None:
        return why
    if not torch.cpu._is_amx_tile_supported():
        return "this CPU lacks AMX-INT8 tiles"
    if (why := isa_ceiling_refuses("amx")) is not None:
        return why
    if not _amx_granted(KERNEL.library()):
        return "the operating system did not grant this process AMX tile state"
    return None


@functools.cache
def _amx_granted(library: ctypes.CDLL) -> bool:
    """Whether the OS gave this process AMX tile state (asked once per loaded library)."""
    return library.npumoe_amx_init() == 0


def unsupported_cpu() -> str | None:
    """Why this CPU cannot run the kernel whatever the compiler does, or None when it can."""
    return cpu_lacks("the VNNI kernel", "x86-64", "AVX512-VNNI", torch.cpu._is_vnni_supported, "avx512_vnni")


KERNEL = native_kernel("vnni_linear", "the VNNI int8/int4 kernel", unsupported_cpu, npumoe_amx_init=())
ISA = IsaKernel("VNNI", KERNEL, "AMX", amx_unavailable)
