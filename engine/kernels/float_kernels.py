"""The matmul kernel the CPU experts run, chosen by timing the candidates on this machine.

Three kernels can run an expert's (N, K) weights: the engine's own bf16 kernel (bf16_linear: x86-64 with
AVX512-BF16, where it builds), oneDNN's packed matmul (x86 CPUs with AVX2 or AVX-512) and plain torch
(everywhere: on Arm it is Apple's Accelerate or OpenBLAS). Which of them is fastest depends on more than
the feature list: on a Zen 4 core the engine's kernel streams an expert's weights faster than oneDNN, on a
CPU with AMX tiles oneDNN's tile matmuls may win, and the torch build matters too. So the features only say
what can run (`unavailable_kernels`); the first layer of each dtype and expert shape on a machine times
those that can on its real weights for a few milliseconds and keeps the fastest (`choose_kernel`), once each has
passed a probe: one expert's product against the float64 one, within its dtype's rounding (`probe_kernels`). The
choice and its figures are kept by the engine's one measured-choice mechanism (choice.py), so later processes
reuse them; `npumoed doctor` shows them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..formats.quantize import error_bound, relative_error
from . import bf16_linear
from .choice import Accuracy, Choice, Measured, time_in_turns

# x86 vector extensions torch reports, which oneDNN's packed matmuls need.
X86 = ("AVX2", "AVX512")

# What a timing run sees: an expert's rows in a 512-token prefill chunk (top-8 of 128 experts: 32 on average),
# a few experts in turn so the weights come from memory rather than cache, as in a layer, and a few
# milliseconds a kernel (choice.Rounds).
ROWS = 32
_ROTATED_BYTES, MAX_ROTATED = 32 * 2**20, 8


def packs(dtype: torch.dtype) -> bool:
    """Whether this x86 CPU has oneDNN's packed-weight matmul for `dtype` (bf16 needs AVX-512 or AMX)."""
    if not torch.backends.mkldnn.is_available() or torch.backends.cpu.get_cpu_capability() not in X86:
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _own_unavailable(weights: Sequence[torch.Tensor]) -> str | None:
    w = weights[0]
    if w.dtype != torch.bfloat16:
        return f"it reads bf16 weights, not {_name(w.dtype)}"
    if not all(bf16_linear.supports(*v.shape[-2:]) for v in weights):
        return f"it needs weights of whole blocks of {bf16_linear.BLOCK} rows and an even width"
    return bf16_linear.unavailable()  # the shapes fit: only now is a build worth trying


def _onednn_unavailable(weights: Sequence[torch.Tensor]) -> str | None:
    dtype = weights[0].dtype
    return None if packs(dtype) else f"this CPU or torch build has no oneDNN packed {_name(dtype)} matmul"


def _onednn_pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous())


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return y if out is None else out.copy_(y)


def _torch_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    y = F.linear(x, w)
    return y if out is None else out.copy_(y)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Candidate:
    """One kernel that can run an expert's (N, K) float weights: how it packs a weight (a copy in the layout it reads),
    how it multiplies (n, K) rows by it into (n, N) (`out` when given), and why it cannot run these weights of one
    dtype on the CPU here (None when it can); it runs on the CPU only unless `anywhere`."""

    pack: Callable[[torch.Tensor], torch.Tensor]
    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    unavailable: Callable[[Sequence[torch.Tensor]], str | None]
    anywhere: bool = False


CANDIDATES = {
    "npumoe-bf16": Candidate(lambda w: bf16_linear.pack(w), lambda x, w, out: bf16_linear.linear(x, w, out),
                             _own_unavailable),
    "onednn": Candidate(_onednn_pack, _onednn_linear, _onednn_unavailable),
    "torch": Candidate(lambda w: w, _torch_linear, lambda weights: None, anywhere=True),  # runs anything
}
KERNELS = tuple(CANDIDATES)


def unavailable_kernels(*weights: torch.Tensor) -> dict[str, str]:
    """The kernels that cannot run these (…, N, K) weights of one dtype and device here, each with why;
    the others can (plain torch runs anything)."""
    device = weights[0].device.type
    reasons = {}
    for kernel, candidate in CANDIDATES.items():
        if device != "cpu" and not candidate.anywhere:
            reasons[kernel] = f"the weights are on {device}, not the CPU"
        elif (why := candidate.unavailable(weights)) is not None:
            reasons[kernel] = why
    return reasons


class PackedLinear:
    """y = x · wᵀ for one (N, K) weight, held in the layout `kernel` reads (a copy, except for plain torch)."""

    def __init__(self, w: torch.Tensor, kernel: str) -> None:
        if kernel not in CANDIDATES:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        self.kernel = kernel
        self._linear = CANDIDATES[kernel].linear
        with torch.no_grad():
            self.weight = CANDIDATES[kernel].pack(w)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(n, K) -> (n, N), written into `out` when given."""
        return self._linear(x, self.weight, out)


CHOICES = Measured("float kernels", (bf16_linear.SOURCE,))


def expert_shape(hidden: int, ffn: int) -> dict[str, int]:
    """An expert's sizes, as its choices are keyed."""
    return {"hidden": hidden, "ffn": ffn}


def choose_kernel(gate_up: torch.Tensor, down: torch.Tensor) -> Choice:
    """The fastest kernel here for experts of these weights' dtype and shapes, timed on one torch thread as an
    expert's worker runs: on them at first use on this machine, then read from the cache."""
    unavailable = unavailable_kernels(gate_up, down)
    candidates = [kernel for kernel in KERNELS if kernel not in unavailable]
    if candidates == ["torch"] or len(gate_up) == 0:  # nothing to compare
        return Choice("torch", {}, unavailable)
    return CHOICES.choose(gate_up.dtype, expert_shape(*down.shape[-2:]), candidates,  # down: (E, H, I)
                          lambda accepted: time_kernels(accepted, gate_up, down), threads=1,
                          unavailable=unavailable, probe=lambda kernels: probe_kernels(kernels, gate_up, down))


def choose_for_shape(hidden: int, ffn: int, dtype: torch.dtype) -> Choice:
    """The choice for experts of these sizes, timed on random weights if this machine has none yet."""
    experts = rotated(3 * hidden * ffn * dtype.itemsize)
    generator = torch.Generator().manual_seed(0)
    gate_up = torch.randn(experts, 2 * ffn, hidden, generator=generator, dtype=dtype)
    down = torch.randn(experts, hidden, ffn, generator=generator, dtype=dtype)
    return choose_kernel(gate_up, down)


def probe_kernels(kernels: Sequence[str], gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, Accuracy]:
    """Each kernel's accuracy on the first expert: the larger relative error of its gate-up and down on ROWS rows
    against their float64 product, and the bound of the weights' dtype."""
    generator = torch.Generator().manual_seed(1)
    weights = (gate_up[0], down[0])
    xs = [torch.randn(ROWS, w.shape[1], generator=generator).to(w.dtype) for w in weights]
    exact = [x.double() @ w.double().T for x, w in zip(xs, weights, strict=True)]
    bound = error_bound(gate_up.dtype)
    return {kernel: Accuracy(max(relative_error(PackedLinear(w, kernel)(x), y)
                                 for w, x, y in zip(weights, xs, exact, strict=True)), bound)
            for kernel in kernels}


def time_kernels(kernels: Sequence[str], gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, float]:
    """Median seconds of one expert's gate-up and down matmuls on ROWS rows, for each kernel, timed in turns
    (so the machine's drift moves all alike) over a few experts' real weights packed for each."""
    count = min(len(gate_up), rotated((gate_up[0].numel() + down[0].numel()) * gate_up.element_size()))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, gate_up.shape[-1], generator=generator).to(gate_up.dtype)
    h = torch.randn(ROWS, down.shape[-1], generator=generator).to(down.dtype)
    packed = {kernel: [(PackedLinear(gate_up[e], kernel), PackedLinear(down[e], kernel)) for e in range(count)]
              for kernel in kernels}

    def run(kernel: str, expert: int) -> None:
        project_up, project_down = packed[kernel][expert]
        project_up(x)
        project_down(h)

    return time_in_turns(kernels, count, run)


def rotated(expert_bytes: int) -> int:
    """How many experts a timing run takes in turn: enough that, as in a layer, most reads miss the caches."""
    return max(1, min(MAX_ROTATED, _ROTATED_BYTES // expert_bytes))
