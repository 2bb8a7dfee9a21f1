"""The engine's own int8 and int4 matmuls for arm64 CPUs with the dot-product instructions, built from neon_linear.c
at first use: vnni_linear's contract (`pack`, `linear`, `silu_glu_expert`) on Arm, which runs them either with SDOT
(asimddp: every Armv8.2-A core on, Apple's M1 included) or with SMMLA (i8mm: Apple M2 on, Graviton 3, Neoverse V1/N2),
both over the same packed weights; quant_kernels offers each as a candidate and the choice measures them.

Why an int4 kernel of its own beside torch's KleidiAI one: KleidiAI rounds each row of x asymmetrically, and on
rows that use the whole int8 range its error adds up along K against the engine's int4 codes (about 2.5 % at
Qwen3-30B-A3B's width of 2,048, over the dynamic bound, so the choice refused it and int4 experts fell back to
dequantizing). Here int4 runs as int8 does: the 4-bit codes are widened to bytes in registers.

Activations are rounded per row to int8 (absmax / 127), with vnni_linear's second level of codes for rows with
outliers, so results are the dequantized reference's up to that rounding. Weights of any shape are padded to whole
blocks of 16 outputs (the padding's codes and scales are 0), int8's inputs to whole octets of 8; int4 takes groups of
a multiple of 16 inputs. Where the CPU is not arm64 with asimddp, `unavailable()` says why and quant_kernels chooses
among the other kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..formats.quantize import INT4, INT8, QuantizedWeight, unpack_int4
from . import host
from .int_linear import IsaKernel, PackedWeight, block_zeros, native_kernel
from .native import cpu_lacks

BLOCK = 16  # output columns per packed weight block, as in neon_linear.c
OCTET = 8  # inputs per SMMLA operand row
HEXADECET = 16  # int4: inputs per 16 bytes of a pair of columns' nibbles (two octets)
# int32 sums of products of two codes of at most 127 each: K up to 2^31 / 127² = 133,144 inputs cannot overflow
MAX_IN_FEATURES = 131072


def unsupported(weight: QuantizedWeight) -> str | None:
    """Why the kernel cannot take this weight, or None."""
    if weight.shape[1] > MAX_IN_FEATURES:
        return f"its int32 sums need inputs of at most {MAX_IN_FEATURES}, not {weight.shape[1]}"
    if weight.format == INT4 and weight.group % HEXADECET:
        return f"it needs int4 groups that are a multiple of {HEXADECET}, not {weight.group}"
    return None


def pack(weight: QuantizedWeight) -> PackedWeight:
    """The weight in the kernel's layout (neon_linear.c), per block of 16 columns, run of inputs and pair of columns:
    int8: codes (N16/16, K8/8, 8, 2, 8), each column's 8 codes of an octet, and scale (N16,) float32;
    int4: codes (N16/16, K/16, 8, 2, 8), each column's 8 codes of a hexadecet's first octet in low nibbles and of its
    second in high ones, and scale and zero (N16/16, K/group, 16) bfloat16."""
    if (why := unsupported(weight)) is not None:
        raise ValueError(f"the NEON kernel cannot take this {weight.format} weight {weight.shape}: {why}")
    n, k = weight.shape
    pad_n = -n % BLOCK
    if weight.format == INT8:
        codes = F.pad(weight.codes, (0, -k % OCTET, 0, pad_n))
        blocks, octets = codes.shape[0] // BLOCK, codes.shape[1] // OCTET
        # (block, pair, column of the pair, octet, 8) -> (block, octet, pair, column of the pair, 8)
        packed = codes.reshape(blocks, BLOCK // 2, 2, octets, OCTET).permute(0, 3, 1, 2, 4).contiguous()
        return PackedWeight(INT8, (n, k), packed, F.pad(weight.scale.float(), (0, pad_n)).contiguous())
    codes = F.pad(unpack_int4(weight.codes), (0, 0, 0, pad_n))  # (N16, K) codes 0..15
    blocks = codes.shape[0] // BLOCK
    # (block, pair, column of the pair, hexadecet, octet of it, 8): the first octet low, the second high
    octets = codes.reshape(blocks, BLOCK // 2, 2, k // HEXADECET, 2, OCTET)
    nibbles = (octets[..., 0, :] | (octets[..., 1, :] << 4)).permute(0, 3, 1, 2, 4).contiguous()

    def per_block(t: torch.Tensor) -> torch.Tensor:  # (N, G) -> (N16/16, G, 16)
        return F.pad(t.to(torch.bfloat16), (0, 0, 0, pad_n)).reshape(blocks, BLOCK, -1).transpose(1, 2).contiguous()

    zero = block_zeros(weight.zero, per_block, (blocks, weight.zero.shape[1], BLOCK))
    return PackedWeight(INT4, (n, k), nibbles, per_block(weight.scale), zero=zero, group=weight.group)


def linear(x: torch.Tensor, packed: PackedWeight, out: torch.Tensor | None = None, *,
           i8mm: bool = False) -> torch.Tensor:
    """(m, K) float32 or bf16 rows times a packed (N, K) weight -> (m, N) in x's dtype, into `out` when given (rows
    may be strided); SMMLA with `i8mm`, else SDOT."""
    return ISA.linear(x, packed, out, variant=i8mm)


def silu_glu_expert(x: torch.Tensor, up: PackedWeight, down: PackedWeight, out: torch.Tensor | None = None, *,
                    i8mm: bool = False) -> torch.Tensor:
    """(m, K) rows through a gated expert (IsaKernel.silu_glu_expert); SMMLA with `i8mm`, else SDOT."""
    return ISA.silu_glu_expert(x, up, down, out, variant=i8mm)


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
    return cpu_lacks("the NEON kernel", "arm64", "the dot-product instructions (asimddp)",
                     lambda: "asimddp" in host.arm_features())


KERNEL = native_kernel("neon_linear", "the NEON int8/int4 kernel", unsupported_cpu)
ISA = IsaKernel("NEON", KERNEL, "i8mm", i8mm_unavailable, variant_takes_int4=True)
