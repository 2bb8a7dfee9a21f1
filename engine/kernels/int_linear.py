"""What the engine's own int8/int4 kernels share on the Python side: the packed weight, its ctypes mirror of the C
`struct npumoe_weight` (npumoe_kernels.h), the checks of their inputs, and `IsaKernel`, the one wrapper of the two
functions each kernel exports (`<prefix>_linear`, `<prefix>_silu_glu_expert`), parameterised by its instruction set.

vnni_linear, avx2_linear and neon_linear each hold one `IsaKernel` and keep their own contract (`linear`,
`silu_glu_expert`, with their faster instructions under their own keyword: `amx`, `vnni`, `i8mm`).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..formats.quantize import INT4
from .native import NativeKernel

HEADER = "npumoe_kernels.h"


@dataclass(frozen=True)
class PackedWeight:
    """A quantized (N, K) weight in a kernel's layout (vnni_linear.pack, neon_linear.pack say which): int8 codes, each
    column's sum of codes (x86 only) and scale; int4 codes, scale, zero and group."""

    format: str
    shape: tuple[int, int]
    codes: torch.Tensor
    scale: torch.Tensor
    sums: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    group: int = 0


class NativeWeight(ctypes.Structure):
    """npumoe_kernels.h's struct npumoe_weight: one packed weight's tensors and sizes."""

    _fields_ = [("codes", ctypes.c_void_p), ("sums", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("zero", ctypes.c_void_p), ("group", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64)]


def block_zeros(zero: torch.Tensor, per_block: Callable[[torch.Tensor], torch.Tensor],
                shape: tuple[int, int, int]) -> torch.Tensor:
    """An int4 weight's zeros in its kernel's block layout (`per_block`, giving `shape`). Symmetric blocks, whose
    zeros are all 0 (Q4_0's: w = d·(q - 8)), share one read-only buffer of that shape, so such a file's experts
    take their own size packed instead of a bf16 zero per group beside each scale (a ninth more)."""
    return per_block(zero) if bool(zero.any()) else _shared_zeros(shape)


@functools.cache
def _shared_zeros(shape: tuple[int, int, int]) -> torch.Tensor:
    with torch.inference_mode(False):  # made once, whatever mode the first weight is packed in
        return torch.zeros(shape, dtype=torch.bfloat16)


def native_weight(packed: PackedWeight) -> NativeWeight:
    """The packed weight as the C kernels' struct npumoe_weight (its tensors' addresses: keep `packed` alive)."""

    def address(t: torch.Tensor | None) -> int | None:
        return None if t is None else t.data_ptr()

    return NativeWeight(packed.codes.data_ptr(), address(packed.sums), packed.scale.data_ptr(), address(packed.zero),
                        packed.group, *packed.shape)


def check_rows(what: str, x: torch.Tensor, out: torch.Tensor, shape: tuple[int, int]) -> None:
    """Refuse x and out unless they are (m, K) and (m, N) float32 or bf16 rows of one dtype, unit-stride, for a
    product of shape (N, K)."""
    m, k = x.shape
    if (x.dtype not in (torch.float32, torch.bfloat16) or out.dtype != x.dtype or k != shape[1]
            or out.shape != (m, shape[0]) or x.stride(1) != 1 or out.stride(1) != 1):
        raise ValueError(f"{what}: x {x.dtype} {tuple(x.shape)}, weight {shape}, out {out.dtype} "
                         f"{tuple(out.shape)}; float32 or bf16 rows, unit-stride")


def check_expert(x: torch.Tensor, up: PackedWeight, down: PackedWeight) -> None:
    """Refuse a gated expert's weights unless they are gate-up (2I, K) and down (N, I) of one format for x's K."""
    inter = down.shape[1]
    if up.format != down.format or up.shape != (2 * inter, x.shape[1]):
        raise ValueError(f"a gated expert needs gate-up (2I, K) and down (N, I) weights of one format, got "
                         f"{up.format} {up.shape} and {down.format} {down.shape}")


_POINTER, _SIZE, _FLAG = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
# npumoe_kernels.h's NPUMOE_EXPORTS: x, m, ldx, bf16, int4, variant, weight(s), y, ldy
_LINEAR = (_POINTER, _SIZE, _SIZE, _FLAG, _FLAG, _FLAG, _POINTER, _POINTER, _SIZE)
_EXPERT = (_POINTER, _SIZE, _SIZE, _FLAG, _FLAG, _FLAG, _POINTER, _POINTER, _POINTER, _SIZE)


def _prefix(name: str) -> str:
    """The prefix of the functions `<isa>_linear.c` exports: npumoe_<isa>."""
    return "npumoe_" + name.removesuffix("_linear")


def native_kernel(name: str, what: str, unsupported_cpu: Callable[[], str | None],
                  **more_functions: tuple[type, ...]) -> NativeKernel:
    """The C source `<isa>_linear.c`, which includes npumoe_kernels.h and exports its pair of functions as
    npumoe_<isa>_linear and npumoe_<isa>_silu_glu_expert (and `more_functions`, each returning an int too)."""
    prefix = _prefix(name)
    return NativeKernel(name, what, {f"{prefix}_linear": _LINEAR, f"{prefix}_silu_glu_expert": _EXPERT,
                                     **more_functions},
                        unsupported_cpu, restype=ctypes.c_int, headers=(HEADER,))


@dataclass(frozen=True)
class IsaKernel:
    """One instruction set's int8/int4 kernel: its C library and its faster variant (AMX tiles, AVX-VNNI, SMMLA),
    which runs where `variant_unavailable` says None, on int4 weights too where `variant_takes_int4`."""

    isa: str  # how messages name it: "VNNI"
    kernel: NativeKernel  # from native_kernel
    variant: str  # how messages name the variant: "AMX"
    variant_unavailable: Callable[[], str | None]
    variant_takes_int4: bool = False

    def linear(self, x: torch.Tensor, packed: PackedWeight, out: torch.Tensor | None = None, *,
               variant: bool = False) -> torch.Tensor:
        """(m, K) float32 or bf16 rows times a packed (N, K) weight -> (m, N) in x's dtype, into `out` when given
        (rows may be strided); on the faster variant with `variant`."""
        m = x.shape[0]
        if out is None:
            out = x.new_empty(m, packed.shape[0])
        check_rows(f"{self.isa} {packed.format} linear", x, out, packed.shape)
        if m and self._function("linear", packed.format, variant)(
                *self._rows(x), int(packed.format == INT4), int(variant), ctypes.byref(native_weight(packed)),
                out.data_ptr(), out.stride(0)):
            raise MemoryError(f"the {self.isa} {packed.format} kernel could not allocate {m} rows of scratch")
        return out

    def silu_glu_expert(self, x: torch.Tensor, up: PackedWeight, down: PackedWeight, out: torch.Tensor | None = None,
                        *, variant: bool = False) -> torch.Tensor:
        """(m, K) rows through a gated expert, silu(gate)·up times `down`, with up = [gate; up] packed (2I, K) and
        down packed (N, I) in one format -> (m, N) in x's dtype, into `out` when given, in one native call; on the
        faster variant with `variant`."""
        check_expert(x, up, down)
        m, k = x.shape
        if out is None:
            out = x.new_empty(m, down.shape[0])
        check_rows(f"{self.isa} {up.format} expert", x, out, (down.shape[0], k))
        if m and self._function("silu_glu_expert", up.format, variant)(
                *self._rows(x), int(up.format == INT4), int(variant), ctypes.byref(native_weight(up)),
                ctypes.byref(native_weight(down)), out.data_ptr(), out.stride(0)):
            raise MemoryError(f"the {self.isa} {up.format} expert could not allocate {m} rows of scratch")
        return out

    @staticmethod
    def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
        return x.data_ptr(), x.shape[0], x.stride(0), int(x.dtype == torch.bfloat16)

    def _function(self, name: str, format: str, variant: bool) -> Callable[..., int]:
        """The loaded kernel's exported `name`, after checking that its variant, when asked for, can take `format`
        here."""
        if variant:
            takes = format != INT4 or self.variant_takes_int4
            why = self.variant_unavailable() if takes else "it takes int8 weights"
            if why is not None:
                raise ValueError(f"the {self.variant} kernel cannot run this: {why}")
        return getattr(self.kernel.library(), f"{_prefix(self.kernel.name)}_{name}")
