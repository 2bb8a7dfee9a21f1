"""Quantized weight formats for the experts: int8 per output channel and int4 in groups along K.

- int8: w[n, k] ≈ q[n, k] · scale[n], q in [-127, 127] (symmetric; -128 unused so -q never overflows).
- int4: w[n, k] ≈ (q[n, k] − 8) · scale[n, g] + zero[n, g] for k in group g of INT4_GROUP columns, q in [0, 15]:
  asymmetric. Each group's codes first span its own min..max; then, twice, its scale and zero are refitted by
  least squares to the codes they gave and the weights rounded again, which clips a group's extremes where that
  lowers its error (a refit that would round the group worse is not taken). The zero point and the refits both
  lower the error of random (Gaussian) expert weights, the refits for about twice the time to quantize; group 32
  costs half a bit more per weight than 64 (5 bits against 4.5 with bf16 scale and zero) for less error
  (`npumoed bench fidelity` measures each format: bench/results/fidelity-weights-*).
  Codes are stored two a byte, the even k in the low nibble: a plain layout any kernel (or Core ML) can read,
  which each kernel repacks for itself.

Weights are rounded to the nearest code of their grid; `reference_linear` is the dequantized matmul the kernels are
checked against, and `error_bound` how far from it a kernel may be: the kernels' tests and the measured kernel
choice (kernels/choice.py, which refuses a kernel above its bound on the machine at hand) read the same bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT8, INT4 = "int8", "int4"
FORMATS = (INT8, INT4)
INT4_GROUP = 32
_INT8_MAX = 127
_INT4_LEVELS = 15
_INT4_MIDDLE = 8
_INT4_REFITS = 2
_ROWS_AT_ONCE = 256
# Relative error against the reference (the float product, or `reference_linear` for quantized weights) a kernel
# may have: float and weight-only kernels that of rounding in the activations' dtype, with any summation order
# (measured: fp32 under 1e-6 at widths up to 4,096, bf16 0.17 % to 0.24 %); kernels that round each row of x to
# int8 too ("dynamic") that rounding's as well (measured 0.6 % to 0.8 % at width 256).
_ROUNDING_BOUNDS = {torch.float32: 1e-5, torch.bfloat16: 0.004}
DYNAMIC_BOUND = 0.012


@dataclass(frozen=True)
class QuantizedWeight:
    """One (N, K) weight in a quantized format (see the module's docstring for what each tensor holds)."""

    format: str
    codes: torch.Tensor  # int8 (N, K) | uint8 (N, K/2)
    scale: torch.Tensor  # int8: (N,) float32 | int4: (N, K/group) bfloat16
    zero: torch.Tensor | None = None  # int4: (N, K/group) bfloat16, the value code 8 stands for
    group: int | None = None  # int4: columns per scale

    @property
    def shape(self) -> tuple[int, int]:
        n, width = self.codes.shape
        return (n, width * 2 if self.format == INT4 else width)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero) if t is not None)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (N, K) float weight these codes stand for."""
        if self.format == INT8:
            return (self.codes.float() * self.scale.float()[:, None]).to(dtype)
        n, k = self.shape
        codes = unpack_int4(self.codes).float().reshape(n, k // self.group, self.group)
        w = (codes - _INT4_MIDDLE) * self.scale.float()[..., None] + self.zero.float()[..., None]
        return w.reshape(n, k).to(dtype)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors to store, by the suffix they are stored under."""
        held = {"codes": self.codes, "scale": self.scale}
        if self.zero is not None:
            held["zero"] = self.zero
        return held

    @classmethod
    def from_tensors(cls, format: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        """A weight from what `tensors()` stored (the group follows from the shapes)."""
        check_format(format)
        codes, scale = tensors["codes"], tensors["scale"]
        if format == INT8:
            return cls(INT8, codes, scale)
        return cls(INT4, codes, scale, tensors["zero"], group=codes.shape[1] * 2 // scale.shape[1])


def check_format(format: str) -> None:
    if format not in FORMATS:
        raise ValueError(f"weights format must be one of {', '.join(FORMATS)}, got {format!r}")


def int4_fits(in_features: int, group: int = INT4_GROUP) -> bool:
    return in_features > 0 and in_features % group == 0 and group % 2 == 0


def quantize(w: torch.Tensor, format: str, *, group: int = INT4_GROUP) -> QuantizedWeight:
    """An (N, K) float weight in `format` (int4 needs K a multiple of `group`)."""
    check_format(format)
    if w.ndim != 2 or not w.is_floating_point():
        raise ValueError(f"quantize needs a 2-D float weight, got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    # a few rows at a time, each made float and contiguous (a transposed view's codes would be strided, which some
    # kernels misread): the temporaries stay a few MB whatever the weight's size (a 152k-row LM head's whole float32
    # copy and its intermediates were 4 GB)
    chunks = (rows.detach().float().contiguous() for rows in w.detach().split(_ROWS_AT_ONCE))
    if format == INT8:
        codes, scale = torch.empty(n, k, dtype=torch.int8), torch.empty(n)
        first = 0
        for rows in chunks:
            rows_scale = rows.abs().amax(dim=1) / _INT8_MAX
            rows_scale = torch.where(rows_scale > 0, rows_scale, 1.0)  # an all-zero row: any scale gives zero codes
            codes[first:first + len(rows)] = torch.round(rows / rows_scale[:, None]).clamp_(-_INT8_MAX, _INT8_MAX)
            scale[first:first + len(rows)] = rows_scale
            first += len(rows)
        return QuantizedWeight(INT8, codes, scale)
    if not int4_fits(k, group):
        raise ValueError(f"int4 needs the input width ({k}) to be a multiple of its even group size {group}")
    parts = [_int4_rows(rows.reshape(len(rows), k // group, group)) for rows in chunks]
    codes, scale, zero = (torch.cat(tensors) for tensors in zip(*parts, strict=True))
    return QuantizedWeight(INT4, pack_int4(codes.reshape(n, k)), scale, zero, group)


def _int4_rows(grouped: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(n, G, group) weights -> their uint8 codes (n, G, group) and bf16 scale and zero (n, G)."""
    low, high = grouped.amin(dim=2), grouped.amax(dim=2)
    scale = (high - low) / _INT4_LEVELS
    codes, scale, zero, error = _int4_codes(grouped, scale, low + _INT4_MIDDLE * scale)
    for _ in range(_INT4_REFITS):
        fitted = _int4_codes(grouped, *_least_squares(grouped, codes - _INT4_MIDDLE, scale, zero))
        better = fitted[3] < error  # per group: a refit that rounds worse (bf16, clamping) is not taken
        codes = torch.where(better[..., None], fitted[0], codes)
        scale, zero, error = (torch.where(better, new, old) for new, old in zip(fitted[1:], (scale, zero, error),
                                                                               strict=True))
    return codes.to(torch.uint8), scale.to(torch.bfloat16), zero.to(torch.bfloat16)


def _int4_codes(grouped: torch.Tensor, scale: torch.Tensor,
                zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, G, group) weights rounded to the nearest codes for each group's scale and zero, those rounded to bf16
    first so that the codes fit what is stored: (codes as float, scale, zero, each group's squared error)."""
    scale = scale.to(torch.bfloat16).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: any scale, its zero exact
    zero = zero.to(torch.bfloat16).float()
    codes = torch.round((grouped - zero[..., None]) / scale[..., None] + _INT4_MIDDLE).clamp_(0, _INT4_LEVELS)
    error = ((codes - _INT4_MIDDLE) * scale[..., None] + zero[..., None] - grouped).square_().sum(dim=2)
    return codes, scale, zero, error


def _least_squares(grouped: torch.Tensor, centred: torch.Tensor, scale: torch.Tensor,
                   zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's scale and zero that fit its weights best, in squared error, with these (code − 8) values
    (where all its codes are equal, the group keeps `scale` and `zero`)."""
    count = grouped.shape[2]
    sum_c, sum_cc = centred.sum(dim=2), centred.square().sum(dim=2)
    sum_w, sum_cw = grouped.sum(dim=2), (centred * grouped).sum(dim=2)
    determinant = count * sum_cc - sum_c.square()
    fits = determinant > 0
    safe = torch.where(fits, determinant, torch.ones_like(determinant))
    fitted_scale = (count * sum_cw - sum_c * sum_w) / safe
    fitted_zero = (sum_w - fitted_scale * sum_c) / count
    return torch.where(fits, fitted_scale, scale), torch.where(fits, fitted_zero, zero)


def stack_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Weights of one format and width stacked along N (quantization is row by row: the gate's and the up's
    stacked are the gate-up's)."""
    if len(weights) == 1:
        return weights[0]
    first = weights[0]
    zero = torch.cat([w.zero for w in weights]) if first.zero is not None else None
    return QuantizedWeight(first.format, torch.cat([w.codes for w in weights]), torch.cat([w.scale for w in weights]),
                           zero, first.group)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes 0..15 -> (N, K/2) uint8, the even k in the low nibble."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(N, K/2) uint8 -> (N, K) uint8 codes 0..15."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def reference_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x · ŵᵀ in float32 with ŵ the dequantized weight: what every quantized kernel approximates."""
    return (x.float() @ weight.dequantize().T).to(x.dtype)


def error_bound(dtype: torch.dtype, *, dynamic: bool = False) -> float:
    """The relative error a kernel with `dtype` activations may have against the reference; `dynamic`: it rounds
    the activations to int8 as well. A dtype without a measured bound gets its unit of least precision."""
    return DYNAMIC_BOUND if dynamic else _ROUNDING_BOUNDS.get(dtype, torch.finfo(dtype).eps)


def relative_error(approximate: torch.Tensor, exact: torch.Tensor) -> float:
    """‖approximate − exact‖ / ‖exact‖, in float64."""
    exact = exact.double()
    return float((approximate.double() - exact).norm() / exact.norm())
