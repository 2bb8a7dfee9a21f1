"""The matmul kernels that run quantized expert weights (quantize.py) on the CPU, chosen by timing on this machine.

int8 weights run through one of
- "npumoe-int8-dynamic": the engine's own kernel (vnni_linear: x86-64 with AVX512-VNNI), which rounds each row
  of x to int8 inside the call and multiplies bytes with VNNI dot products over weights packed for it;
- "npumoe-int8-amx-dynamic": the same on AMX-INT8 tiles, 16 rows at a time (Intel Xeons from Sapphire Rapids);
- "npumoe-int8-avx2-dynamic": the engine's own for x86-64 with AVX2 but no VNNI (avx2_linear: the same rounding
  and packed weights, byte products whose pair sums cannot saturate), and "npumoe-int8-avxvnni-dynamic", the same
  on AVX-VNNI's dot products (Intel's client cores from Alder Lake, AMD's from Zen 5);
- "npumoe-int8-sdot-dynamic" and "npumoe-int8-i8mm-dynamic": the engine's own kernel for arm64 (neon_linear), with
  SDOT dot products, or SMMLA 2x8 matrix products where the CPU has i8mm (int4: "npumoe-int4-sdot-dynamic" and
  "npumoe-int4-i8mm-dynamic", the same with the 4-bit codes widened to bytes in registers);
- "onednn-dynamic": each row of x rounded to int8 with its own scale, times the int8 weights in oneDNN's
  prepacked layout (VNNI or AMX-INT8 dot products where the CPU has them; x86 with oneDNN only);
- "int-mm-dynamic": the same rounding of x, through torch's `_int_mm` (int8 x int8 -> int32);
- "int8pack": torch's weight-only `_weight_int8pack_mm` (x stays float; the weights widen inside the kernel);
- "dequantize": the float weight rebuilt each call and a float matmul (runs anywhere, the slowest).
int4 weights run through the engine's own "npumoe-int4-dynamic" (vnni_linear: x rounded to int8 as above, the
4-bit codes widened to bytes in registers), its AVX2 and NEON siblings (avx2_linear, neon_linear), torch's
`_weight_int4pack_mm_for_cpu` ("int4pack", weights repacked for it; output widths a multiple of 16), torch's
KleidiAI-backed `_dyn_quant_matmul_4bit` ("kleidiai-int4-dynamic", Arm builds of torch: x rounded to int8 per row
inside the call; its weights are symmetric, code − 8 times a bf16 scale per group of 32s, so the engine's zero
points are added after, as each group's sum of x times its zero) or
"dequantize".

The dynamic kernels round the activations too, so they sit further from the dequantized reference than the
weight-only ones (`npumoed bench fidelity` measures both: bench/results/fidelity-weights-*).

The engine's own kernels also run a whole silu-gated expert (gate-up, silu(gate)·up, down) in one native call
(`silu_glu_ffn`), the intermediate values in float32 inside it; the others run the two matmuls with the gate
between them in torch.

As for the float kernels (float_kernels), the features say only what can run (`unavailable_kernels`); the first
layer of each format, activation dtype and expert shape probes those that can against the dequantized reference
(`probe_kernels`), refusing those above their bound (`bound`), times the others on a whole silu-gated expert, and
keeps the fastest, through the measured-choice mechanism (choice.py) like them. The probe is what keeps a kernel
that computes wrong on a CPU out: on x86 without VNNI oneDNN's int8 matmul (and torch's `_int_mm`, which runs on
it) adds pairs of u8×s8 products in int16, which saturates, to several times the dynamic bound (activations at 7
bits would avoid it at about twice the rounding error, above that bound too).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from ..formats.quantize import (
    INT4,
    INT8,
    QuantizedWeight,
    check_format,
    error_bound,
    quantize,
    relative_error,
    unpack_int4,
)
from . import avx2_linear, neon_linear, vnni_linear
from .choice import Accuracy, Choice, Measured, time_in_turns
from .float_kernels import ROWS, X86, expert_shape, rotated


@dataclass(frozen=True)
class Own:
    """One of the engine's own kernels: `module`'s `linear` and `silu_glu_expert` run it (a whole silu-gated expert in
    one call), on its faster instructions when `variant` names their keyword ("amx"), over weights laid out by
    `packing`'s `pack` (whose `unsupported` says which it cannot take)."""

    module: ModuleType
    packing: ModuleType
    variant: str | None = None

    @property
    def options(self) -> Mapping[str, bool]:
        """The keyword arguments of its calls."""
        return {} if self.variant is None else {self.variant: True}

    def unavailable(self, weights: Sequence[QuantizedWeight]) -> str | None:
        """Why it cannot run these weights here, or None."""
        cannot_take = {why for w in weights if (why := self.packing.unsupported(w)) is not None}
        if cannot_take:
            return "; ".join(sorted(cannot_take))
        if self.variant is None:
            return self.module.unavailable()  # the shapes fit: only now is a build worth trying
        return self.module.ISA.variant_unavailable()


OWN = {INT8: "npumoe-int8-dynamic", INT4: "npumoe-int4-dynamic"}  # vnni_linear's kernel for each format
AMX = "npumoe-int8-amx-dynamic"
AVX2 = {INT8: "npumoe-int8-avx2-dynamic", INT4: "npumoe-int4-avx2-dynamic"}  # avx2_linear's, over vnni_linear.pack
AVX_VNNI = "npumoe-int8-avxvnni-dynamic"  # avx2_linear's int8 on AVX-VNNI
# neon_linear's kernels of each format: SDOT, then SMMLA (i8mm)
NEON = {INT8: ("npumoe-int8-sdot-dynamic", "npumoe-int8-i8mm-dynamic"),
        INT4: ("npumoe-int4-sdot-dynamic", "npumoe-int4-i8mm-dynamic")}
OWN_KERNELS = {
    **{OWN[format]: Own(vnni_linear, vnni_linear) for format in (INT8, INT4)},
    AMX: Own(vnni_linear, vnni_linear, "amx"),
    **{AVX2[format]: Own(avx2_linear, vnni_linear) for format in (INT8, INT4)},
    AVX_VNNI: Own(avx2_linear, vnni_linear, "vnni"),
    **{sdot: Own(neon_linear, neon_linear) for sdot, _ in NEON.values()},
    **{i8mm: Own(neon_linear, neon_linear, "i8mm") for _, i8mm in NEON.values()},
}
KLEIDIAI = "kleidiai-int4-dynamic"
_KLEIDIAI_GROUP = 32  # KleidiAI's 4-bit kernels take groups that are multiples of this
# the kernels that run a whole silu-gated expert in one call
FUSED = tuple(OWN_KERNELS)
SILU = ("silu", "swish")  # transformers' names (ACT2FN) for silu
KERNELS = {INT8: (OWN[INT8], AMX, AVX2[INT8], AVX_VNNI, *NEON[INT8], "onednn-dynamic", "int-mm-dynamic", "int8pack",
                  "dequantize"),
           INT4: (OWN[INT4], AVX2[INT4], *NEON[INT4], KLEIDIAI, "int4pack", "dequantize")}
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)
_INT4PACK_WIDTH = 16  # output columns the int4 kernel's packing works in
_INT4PACK_GROUPS = (32, 64, 128, 256)
CHOICES = Measured("quantized kernels", (Path(__file__), *vnni_linear.KERNEL.sources, *avx2_linear.KERNEL.sources,
                                         *neon_linear.KERNEL.sources))


def bound(kernel: str, dtype: torch.dtype) -> float:
    """The relative error `kernel` may have against the dequantized reference with `dtype` activations."""
    return error_bound(dtype, dynamic=kernel.endswith("-dynamic"))


def unavailable_kernels(format: str, dtype: torch.dtype, *weights: QuantizedWeight) -> dict[str, str]:
    """The kernels of `format` that cannot run these weights with `dtype` activations here, each with why."""
    check_format(format)
    if dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"quantized kernels take float32 or bfloat16 activations, not {dtype}")
    reasons = {kernel: why for kernel in KERNELS[format]
               if kernel in OWN_KERNELS and (why := OWN_KERNELS[kernel].unavailable(weights)) is not None}
    if format == INT8:
        if not torch.backends.mkldnn.is_available() or torch.backends.cpu.get_cpu_capability() not in X86:
            reasons["onednn-dynamic"] = "this CPU or torch build has no oneDNN int8 matmul"
    else:
        if (why := _kleidiai_unavailable(weights)) is not None:
            reasons[KLEIDIAI] = why
        if any(w.shape[0] % _INT4PACK_WIDTH or w.group not in _INT4PACK_GROUPS for w in weights):
            reasons["int4pack"] = (f"it needs output widths that are a multiple of {_INT4PACK_WIDTH} and groups of "
                                   f"{', '.join(map(str, _INT4PACK_GROUPS))}")
    return reasons


def _kleidiai_unavailable(weights: Sequence[QuantizedWeight]) -> str | None:
    """Why torch's KleidiAI 4-bit kernel cannot run these weights here, or None. Off Arm, torch has the op too, as a
    reference loop (no use to the choice, but it lets x86 test the mapping of the engine's int4 onto it)."""
    if not torch.backends.kleidiai.is_available():
        return "this torch build has no KleidiAI kernels (Arm builds do)"
    if any(w.group % _KLEIDIAI_GROUP for w in weights):
        return f"it needs int4 groups that are a multiple of {_KLEIDIAI_GROUP}"
    return None


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x as int8 codes and its float32 scale (n, 1): x ≈ codes · scale, symmetric; x times the scale's
    reciprocal, rounded to nearest even (as the engine's own kernels round)."""
    scale = x.abs().amax(dim=1, keepdim=True).float().div_(127).clamp_min_(torch.finfo(torch.float32).tiny)
    return torch.round(x.float() * scale.reciprocal()).to(torch.int8), scale


class QuantLinear:
    """y = x · ŵᵀ for one quantized (N, K) weight ŵ, held in the layout `kernel` reads, for `dtype` activations:
    the call contract of float_kernels.PackedLinear, (n, K) -> (n, N)."""

    def __init__(self, weight: QuantizedWeight, kernel: str, dtype: torch.dtype) -> None:
        if kernel not in KERNELS[weight.format]:
            raise ValueError(f"{weight.format} kernel must be one of {', '.join(KERNELS[weight.format])}, "
                             f"got {kernel!r}")
        if dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"quantized kernels take float32 or bfloat16 activations, not {dtype}")
        self.kernel, self.dtype, self.shape = kernel, dtype, weight.shape
        self.nbytes = weight.nbytes
        if kernel in OWN_KERNELS:
            self._packed = OWN_KERNELS[kernel].packing.pack(weight)
        elif kernel == KLEIDIAI:
            self._codes = torch.ops.aten._dyn_quant_pack_4bit_weight(weight.codes, weight.scale, None, weight.group,
                                                                     *reversed(self.shape))
            self._group, self._zero = weight.group, weight.zero.float().T.contiguous()  # (K/group, N)
        elif kernel == "dequantize":
            self._weight = weight
        elif kernel == "onednn-dynamic":
            self._codes = torch.ops.onednn.qlinear_prepack(weight.codes, None)
            self._scale = weight.scale.float()
            self._zeros = torch.zeros(self.shape[0], dtype=torch.int64)
        elif kernel == "int-mm-dynamic":
            self._codes_t = weight.codes.T  # (K, N), the second operand's shape
            self._scale = weight.scale.float()
        elif kernel == "int8pack":
            self._codes = weight.codes
            self._scale = weight.scale.to(dtype)
        else:  # int4pack
            self._codes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(weight.codes).int(), 1)
            self._group = weight.group
            self._scales_zeros = torch.stack((weight.scale.T, weight.zero.T), dim=-1).to(dtype).contiguous()

    @classmethod
    def from_float(cls, w: torch.Tensor, format: str, kernel: str, dtype: torch.dtype | None = None) -> QuantLinear:
        """A float (N, K) weight quantized to `format`, for activations of `dtype` (w's dtype by default)."""
        return cls(quantize(w, format), kernel, dtype or w.dtype)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(n, K) -> (n, N) in x's dtype, written into `out` when given."""
        self._check(x)
        if (own := OWN_KERNELS.get(self.kernel)) is not None:
            return own.module.linear(x, self._packed, out, **own.options)
        y = self._product(x)
        return y if out is None else out.copy_(y)

    def _check(self, x: torch.Tensor) -> None:
        if x.dtype != self.dtype or x.ndim != 2 or x.shape[1] != self.shape[1]:
            raise ValueError(f"quantized linear for {self.dtype} rows of width {self.shape[1]}, got {x.dtype} "
                             f"{tuple(x.shape)}")

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "dequantize":
            return F.linear(x, self._weight.dequantize(self.dtype))
        if self.kernel == "int8pack":
            return torch.ops.aten._weight_int8pack_mm(x.contiguous(), self._codes, self._scale)
        if self.kernel == "int4pack":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self._codes, self._group,
                                                              self._scales_zeros)
        if self.kernel == KLEIDIAI:  # float32 rows: what every build of the op takes
            rows = x.float().contiguous()
            y = torch.ops.aten._dyn_quant_matmul_4bit(rows, self._codes, self._group, *reversed(self.shape))
            return y.addmm_(rows.reshape(len(rows), -1, self._group).sum(dim=2), self._zero).to(self.dtype)
        codes, row_scale = quantize_rows(x)
        if self.kernel == "onednn-dynamic":
            y = torch.ops.onednn.qlinear_pointwise(codes, 1.0, 0, self._codes, self._scale, self._zeros, None, 1.0, 0,
                                                   torch.float32, "none", [], "")
        else:
            y = torch._int_mm(codes, self._codes_t).float().mul_(self._scale)
        return y.mul_(row_scale).to(self.dtype)


def silu_glu_ffn(gate_up: QuantLinear, down: QuantLinear, x: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """(n, K) rows through a silu-gated expert: silu(gate)·up from `gate_up` (gate rows first), through `down`, into
    `out` when given; one native call on the engine's own kernels."""
    if gate_up.kernel != down.kernel or gate_up.dtype != down.dtype:
        raise ValueError(f"an expert's projections need one kernel and dtype, got {gate_up.kernel} {gate_up.dtype} "
                         f"and {down.kernel} {down.dtype}")
    own = OWN_KERNELS.get(gate_up.kernel)
    if own is None:
        gate, up = gate_up(x).chunk(2, dim=-1)
        return down(F.silu(gate) * up, out)
    gate_up._check(x)
    return own.module.silu_glu_expert(x, gate_up._packed, down._packed, out, **own.options)


def choose_kernel(gate_up: Sequence[QuantizedWeight], down: Sequence[QuantizedWeight],
                  dtype: torch.dtype) -> Choice:
    """The fastest kernel here for experts of these quantized weights (gate-up (2I, H) and down (H, I) per
    expert) with `dtype` activations: timed on them at first use on this machine, then read from the cache."""
    format = gate_up[0].format
    unavailable = unavailable_kernels(format, dtype, *gate_up, *down)
    candidates = [kernel for kernel in KERNELS[format] if kernel not in unavailable]
    if len(candidates) == 1:
        return Choice(candidates[0], {}, unavailable)
    return CHOICES.choose(dtype, {"format": format, **expert_shape(*down[0].shape)}, candidates,
                          lambda accepted: time_kernels(accepted, gate_up, down, dtype), threads=1,
                          unavailable=unavailable, probe=lambda kernels: probe_kernels(kernels, gate_up[0], dtype))


def choose_for_shape(hidden: int, ffn: int, format: str, dtype: torch.dtype) -> Choice:
    """The choice for experts of these sizes, timed on random weights if this machine has none yet."""
    check_format(format)
    experts = rotated(3 * hidden * ffn * (1 if format == INT8 else 2))
    generator = torch.Generator().manual_seed(0)
    gate_up = [quantize(torch.randn(2 * ffn, hidden, generator=generator), format) for _ in range(experts)]
    down = [quantize(torch.randn(hidden, ffn, generator=generator), format) for _ in range(experts)]
    return choose_kernel(gate_up, down, dtype)


def probe_rows(rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """What a probe multiplies: Gaussian rows, every other one ±1 instead, which a dynamic kernel rounds to ±127
    exactly: the whole int8 range, where a kernel whose sums saturate (int16 on x86 without VNNI) shows it
    (Gaussian rows alone put it at 1.2 %, the bound's edge, on an expert's real sizes)."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(rows, width, generator=generator)
    x[1::2] = torch.randint(0, 2, (rows // 2, width), generator=generator) * 2.0 - 1
    return x.to(dtype)


def probe_kernels(kernels: Sequence[str], weight: QuantizedWeight, dtype: torch.dtype,
                  rows: int = ROWS) -> dict[str, Accuracy]:
    """Each kernel's accuracy on `weight` (an expert's gate-up): its relative error on `rows` `probe_rows` against
    the float64 product with the dequantized weight, and its bound."""
    x = probe_rows(rows, weight.shape[1], dtype)
    exact = x.double() @ weight.dequantize().double().T
    return {kernel: Accuracy(relative_error(QuantLinear(weight, kernel, dtype)(x), exact), bound(kernel, dtype))
            for kernel in kernels}


def time_kernels(kernels: Sequence[str], gate_up: Sequence[QuantizedWeight], down: Sequence[QuantizedWeight],
                 dtype: torch.dtype) -> dict[str, float]:
    """Median seconds of one silu-gated expert (`silu_glu_ffn`) on ROWS rows, for each kernel, timed in turns over a
    few experts' real weights packed for each."""
    count = min(len(gate_up), rotated(gate_up[0].nbytes + down[0].nbytes))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, gate_up[0].shape[1], generator=generator).to(dtype)
    packed = {kernel: [(QuantLinear(gate_up[e], kernel, dtype), QuantLinear(down[e], kernel, dtype))
                       for e in range(count)] for kernel in kernels}

    def run(kernel: str, expert: int) -> None:
        silu_glu_ffn(*packed[kernel][expert], x)

    return time_in_turns(kernels, count, run)
