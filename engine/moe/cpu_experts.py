"""The exact CPU expert path: each expert's rows through its own FFN, experts run side by side.

An expert's FFN is the one its module's `ExpertsLayout` describes (experts_layout.py): the input projection,
its bias, the layout's gate or activation, the down projection and its bias.

Two choices make it fast on a CPU:
- Weights are packed once, when the layer is built, into the layout the matmul kernel reads in order: the
  kernel measured fastest on this machine for the experts' dtype and shapes (float_kernels: the engine's own
  bf16 kernel, oneDNN's packed matmul, or plain torch, as this CPU allows). With a quantized `format` (int8,
  int4) each weight is quantized first (quantize.py) and packed for the quantized kernel measured fastest
  (quant_kernels), the activations staying in the weights' float dtype. Packed weights are a copy, made
  expert by expert; the caller may then release the module's own (release.py).
- Cores split the experts, not each matmul: every worker thread runs whole experts single-threaded.
  One worker takes the heaviest expert left, the next the lightest, so compute-bound heavy experts
  run beside memory-bound light ones; and a layer waits for its workers once instead of once per
  matmul, which matters when another process holds a core.
"""

from __future__ import annotations

import ctypes
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import islice

import torch
from torch import nn

from ..formats.quantize import QuantizedWeight, check_format, quantize
from ..kernels import quant_kernels
from ..kernels.float_kernels import MAX_ROTATED, PackedLinear, choose_kernel
from ..kernels.quant_kernels import QuantLinear
from ..kernels.workers import one_torch_thread
from .experts_layout import DEFAULT_LAYOUT, GLU, ExpertsLayout, ExpertWeights
from .release import weights_identity

Linear = PackedLinear | QuantLinear
# one expert's gate-up (n·I, H) and down (H, I) weights in the engine's form: float, or quantized
Expert = tuple[torch.Tensor | QuantizedWeight, torch.Tensor | QuantizedWeight]
TIMED_EXPERTS = MAX_ROTATED  # the most experts a kernel choice times: the first ones are held until it is made

class CpuExperts:
    """E expert FFNs of one layout on dynamic rows, weights in the layout of the matmul kernel fastest here:
    float as given, or quantized to `format` ("int8", "int4")."""

    def __init__(self, weights: ExpertWeights, layout: ExpertsLayout = DEFAULT_LAYOUT,
                 format: str | None = None) -> None:
        self._pack(((weights.gate_up[e], weights.down[e]) for e in range(len(weights))), weights.gate_up.dtype,
                   layout, format)
        self.gate_up_bias, self.down_bias = weights.gate_up_bias, weights.down_bias
        self._source = weights_identity(*weights.source)

    @classmethod
    def streamed(cls, experts: Iterable[Expert], dtype: torch.dtype, layout: ExpertsLayout = DEFAULT_LAYOUT,
                 format: str | None = None, gate_up_bias: torch.Tensor | None = None,
                 down_bias: torch.Tensor | None = None) -> CpuExperts:
        """Experts packed as they come, in order, each as its (n·I, H) gate-up and (H, I) down weights in the
        engine's form (float, or already in `format`), with `dtype` activations: a loader reading them one at a
        time never holds more than the packed ones and a few being read. Packed from no module's tensors."""
        experts_ = cls.__new__(cls)
        experts_._pack(iter(experts), dtype, layout, format)
        experts_.gate_up_bias, experts_.down_bias = gate_up_bias, down_bias
        experts_._source = ()
        return experts_

    def _pack(self, experts: Iterator[Expert], dtype: torch.dtype, layout: ExpertsLayout, format: str | None) -> None:
        """Choose the kernel on the first experts, then pack every expert for it, letting each go once packed, on one
        torch thread (what `experts` converts as it is read too)."""
        with one_torch_thread():
            self._pack_each(experts, dtype, layout, format)

    def _pack_each(self, experts: Iterator[Expert], dtype: torch.dtype, layout: ExpertsLayout,
                   format: str | None) -> None:
        if format is not None:
            check_format(format)
        self.layout, self.format = layout, format
        in_format = (tuple(_in_format(w, format) for w in expert) for expert in experts)
        timed = deque(islice(in_format, TIMED_EXPERTS))  # what a kernel choice times, at most
        if format is None:
            self.kernel = choose_kernel(torch.stack([up for up, _ in timed]), torch.stack([d for _, d in timed])).winner
        else:
            self.kernel = quant_kernels.choose_kernel([up for up, _ in timed], [d for _, d in timed], dtype).winner

        def each() -> Iterator[tuple[torch.Tensor | QuantizedWeight, ...]]:
            while timed:
                yield timed.popleft()
            yield from in_format

        self.gate_up: list[Linear] = []
        self.down: list[Linear] = []
        for gate_up, down in each():
            self.gate_up.append(self._linear(gate_up, dtype))
            self.down.append(self._linear(down, dtype))
            if format is not None:
                # quantizing leaves holes of float temporaries between the packed weights that glibc keeps rather
                # than reuse; given back expert by expert, a real-geometry layer's int8 load peaks 1.1 GiB lower
                _give_back_freed_memory()
        _give_back_freed_memory()

    def _linear(self, w: torch.Tensor | QuantizedWeight, dtype: torch.dtype) -> Linear:
        return PackedLinear(w, self.kernel) if self.format is None else QuantLinear(w, self.kernel, dtype)

    @property
    def _fused(self) -> bool:
        """Silu-gated experts without biases on the engine's own quantized kernels: one native call an expert."""
        return (self.kernel in quant_kernels.FUSED and self.layout.gate == GLU
                and self.layout.activation in quant_kernels.SILU and self.gate_up_bias is None
                and self.down_bias is None)

    def packed_from(self, weights: ExpertWeights, format: str | None = None) -> bool:
        """Whether these are the very weights this was packed from, unchanged since, in `format`."""
        return self.format == format and self._source == weights_identity(*weights.source)

    def now_from(self, *source: torch.Tensor) -> None:
        """Take `source` as the tensors these were packed from: the placeholders that replaced the originals."""
        self._source = weights_identity(*source)

    def __len__(self) -> int:
        return len(self.gate_up)

    def __call__(self, expert: int, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(n, H) rows through expert `expert`: (n, n·I) -> (n, I) -> (n, H), written into `out` when given."""
        if self._fused:
            return quant_kernels.silu_glu_ffn(self.gate_up[expert], self.down[expert], x, out)
        h = self.gate_up[expert](x)
        if self.gate_up_bias is not None:
            h += self.gate_up_bias[expert]
        y = self.down[expert](self.layout.apply(h), out)
        if self.down_bias is not None:
            y += self.down_bias[expert]
        return y


def held_packed(module: nn.Module, weights: ExpertWeights, format: str | None) -> CpuExperts | None:
    """The copy of the experts module's `weights` the engine holds packed in `format` (the loader's or a runtime's),
    if it holds one made from them as they are now. The module keeps it by a weak reference (`_npumoe_packed`)."""
    held = getattr(module, "_npumoe_packed", None)
    experts = held() if held is not None else None
    return experts if experts is not None and experts.packed_from(weights, format) else None


def _in_format(w: torch.Tensor | QuantizedWeight, format: str | None) -> torch.Tensor | QuantizedWeight:
    """An expert weight in `format`: quantized now if it came as float (None: float, as it came)."""
    if isinstance(w, QuantizedWeight):
        if w.format != format:
            raise ValueError(f"experts packed {format or 'float'} were given {w.format} weights")
        return w
    return w if format is None else quantize(w, format)


def _glibc_trim() -> Callable[[int], int] | None:
    libc = ctypes.CDLL(None)  # the symbols already loaded: libc's among them
    return getattr(libc, "malloc_trim", None)


_MALLOC_TRIM = _glibc_trim()


def _give_back_freed_memory() -> None:
    """Return the heap memory freed so far to the system. Quantizing frees many float temporaries of an expert's
    size, which glibc keeps for reuse rather than returning (measured: 1.8 GiB of a real-geometry 2-layer model's
    int8 load); other C libraries return such blocks themselves and have no malloc_trim."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
