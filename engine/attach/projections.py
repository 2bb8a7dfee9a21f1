"""The model's dense projections outside the routed experts, run through the engine's measured kernel choice.

Which: every plain `nn.Linear` of the model but the routed experts and what sits beside them in their MoE block
(routers, shared-expert gates): attention's Q/K/V/O (and latent projections where a family has them), dense
layers' FFNs and shared experts, and the LM head, whose kernel is chosen on one row: generation asks it for the
last position only, so decode steps are where it runs, reading its whole weight (the largest single matrix of a
small model) for one token. Embeddings and norms are not linear layers.

How: `MoeRuntime.attach` puts a `ProjectionLinear` in each such Linear's place in its parent (`DenseProjections`;
detach puts the original back; no model code is patched). It holds the weight packed for the kernel measured
fastest for that weight's shape at a prefill chunk's rows with this process's torch threads: the float kernels
the experts choose among (float_kernels; exact: torch's product up to summation order) and, with a quantized
format, the quantized ones too (quant_kernels; int8 rounds each row of x dynamically), which win only where they
measure faster than float at that shape, each within its bound first (`probe_projections`: a few rows against
the float64 product with the weight, or with the dequantized one for a quantized kernel). Where plain torch wins,
the Linear stays as it is. Choices are cached per machine like the experts'. Beside int4 experts the projections
take int8 at most (`projection_format`).

The engine's own kernels (bf16_linear, vnni_linear, avx2_linear) run on one thread: a projection's rows are split
over the experts' workers (kernels/workers.py). torch's and oneDNN's kernels use torch's threads themselves.

With `release`, the Linear's own weight is freed once packed (a placeholder of its shape over one element, as
for the experts: moe/release.py), so the packed weight is the one copy; the original module then computes nothing
useful without a runtime attached.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from weakref import ref

import torch
from torch import nn

from ..formats.quantize import INT8, QuantizedWeight, error_bound, quantize, relative_error
from ..kernels import avx2_linear, bf16_linear, quant_kernels, vnni_linear
from ..kernels.choice import Accuracy, Choice, Measured, time_in_turns
from ..kernels.float_kernels import KERNELS as FLOAT_KERNELS
from ..kernels.float_kernels import PackedLinear, unavailable_kernels
from ..kernels.quant_kernels import ACTIVATION_DTYPES, QuantLinear
from ..kernels.workers import run_tasks
from ..moe.model_experts import expert_layouts
from ..moe.release import release_weights, weights_identity
from ..vocabulary import CHUNK_TOKENS
from .slots import Slot, SlotSwaps

ROWS = CHUNK_TOKENS  # rows a timing run multiplies: one prefill chunk of the engine's default length
# The LM head's rows: generation asks it for the last position only, one row a decode step (prefill yields hidden
# states), so its kernel is timed there, where reading the weight is all the work.
HEAD_ROWS = 1
PROBE_ROWS = 32  # rows the accuracy probe multiplies: two AMX tiles' height, so every kernel's tiled path runs
OWN_PREFIX = "npumoe-"  # the engine's own kernels, which run single-threaded
# Rebuilds the float weight at every call: never faster than the float kernels it ends in.
_NEVER_FASTER = "dequantize"
_SPLIT_ROWS = 16  # rows split over workers in multiples of an AMX tile's height
TIMED_ROWS = 16384  # the most output rows of a weight its kernel choice builds candidates of and times
CHOICES = Measured("projections", (Path(__file__), bf16_linear.SOURCE, Path(quant_kernels.__file__),
                                   vnni_linear.KERNEL.source, avx2_linear.KERNEL.source))

Kernel = PackedLinear | QuantLinear


def multiply(kernel: str, linear: Kernel, x: torch.Tensor, out_features: int) -> torch.Tensor:
    """(m, K) rows through `linear` (run by `kernel`) -> (m, N): the engine's own kernels on the workers, rows
    split between them; the others on the caller's torch threads."""
    if not kernel.startswith(OWN_PREFIX):
        return linear(x)
    m = x.shape[0]
    out = x.new_empty(m, out_features)
    step = max(_SPLIT_ROWS, -(-m // torch.get_num_threads() // _SPLIT_ROWS) * _SPLIT_ROWS)
    run_tasks([partial(linear, x[start:start + step], out[start:start + step]) for start in range(0, m, step)])
    return out


class ProjectionLinear(nn.Module):
    """A Linear's y = x·wᵀ + b with w held for the kernel measured fastest here (`kernel`), quantized when
    `format` (int8: projection_format) is set; the original Linear is kept (not as a submodule) to be put back."""

    def __init__(self, original: nn.Linear, linear: Kernel, kernel: str, format: str | None) -> None:
        super().__init__()
        object.__setattr__(self, "original", original)  # not a submodule: the model holds one of the two at a time
        self.linear, self.kernel, self.format = linear, kernel, format
        self.in_features, self.out_features = original.in_features, original.out_features
        self.bias = original.bias  # the same tensor, not a copy
        self.weight_nbytes = linear.nbytes if isinstance(linear, QuantLinear) else original.weight.nbytes
        self._source = weights_identity(original.weight)

    def packed_from(self, original: nn.Linear) -> bool:
        """Whether this was packed from `original`'s current weight, unchanged since."""
        return self._source == weights_identity(original.weight)

    def now_from(self, weight: torch.Tensor) -> None:
        """Take `weight` (the placeholder that replaced the original's) as the one this was packed from."""
        self._source = weights_identity(weight)

    @property
    def weight(self) -> torch.Tensor:  # what callers of get_output_embeddings() read when this is the head
        return self.original.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # contiguous: the head gets the last position's slice, rows with a whole chunk's stride (see HeadRows)
        rows = x.reshape(-1, self.in_features).contiguous()
        y = multiply(self.kernel, self.linear, rows, self.out_features)
        if self.bias is not None:
            y += self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"kernel={self.kernel}")


class HeadRows(nn.Module):
    """The LM head where plain torch is fastest (`_head`), computed on its rows as one contiguous (m, K) matrix.
    Decoding hands it a slice of the last position, (1, 1, K) with the stride of a whole chunk; for such a bf16
    input torch 2.13 on the CPU copies the whole (V, K) weight, 0.6 GiB and seconds for a 150k vocabulary, where
    the same product on (1, K) rows does not. The original Linear is kept (not as a submodule) and computes it:
    same weight, same kernel."""

    def __init__(self, original: nn.Linear) -> None:
        super().__init__()
        object.__setattr__(self, "original", original)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = self.original(x.reshape(-1, self.original.in_features).contiguous())
        return y.reshape(*x.shape[:-1], self.original.out_features)

    @property
    def weight(self) -> torch.Tensor:  # what callers of get_output_embeddings() read
        return self.original.weight


def projection_format(experts_format: str | None) -> str | None:
    """The quantized format dense projections may take beside experts in `experts_format`: int8 at most. They are a
    few percent of a MoE model's bytes (Qwen3-30B-A3B's attention: 0.9 of 30.5 billion parameters) but every
    token passes through all of them, so int4 there multiplies the whole model's error for little memory
    (llama.cpp's Q4_K_M keeps attention's value projection at 6 bits in many layers for the same reason)."""
    return None if experts_format is None else INT8


def choose_projection(weight: torch.Tensor, format: str | None,
                      rows: int = ROWS) -> tuple[Choice, Callable[[], Kernel]]:
    """The kernel measured fastest here for a Linear of this (N, K) weight (its dtype, `format` allowing) on
    `rows` rows, and how to build it; timed on this weight at first use on this machine, then read from the
    cache. A weight of more than TIMED_ROWS outputs is timed and probed on its first TIMED_ROWS: every candidate
    is built at once to be timed in turns, which for a 152k-row LM head would be gigabytes beside the model."""
    sample = weight[:TIMED_ROWS]
    builders: dict[str, Callable[[], Kernel]] = {}
    unavailable = unavailable_kernels(sample)
    for kernel in FLOAT_KERNELS:
        if kernel not in unavailable:
            builders[kernel] = partial(PackedLinear, sample, kernel)
    quantized: QuantizedWeight | None = None
    if format is not None and weight.dtype in ACTIVATION_DTYPES:
        quantized = quantize(sample, format)
        cannot = quant_kernels.unavailable_kernels(format, weight.dtype, quantized)
        unavailable |= cannot
        for kernel in quant_kernels.KERNELS[format]:
            if kernel not in cannot and kernel != _NEVER_FASTER:
                builders[kernel] = partial(QuantLinear, quantized, kernel, weight.dtype)
    if list(builders) == ["torch"]:
        return Choice("torch", {}, unavailable), partial(PackedLinear, weight, "torch")
    packed: dict[str, Kernel] = {}  # what timing built, kept for the winner

    def build(kernel: str) -> Kernel:
        if kernel not in packed:
            packed[kernel] = builders[kernel]()
        return packed[kernel]

    def timer(accepted: Sequence[str]) -> dict[str, float]:
        x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        for kernel in set(packed) - set(accepted):  # refused: not kept
            del packed[kernel]
        return time_in_turns(accepted, 1, lambda kernel, _: multiply(kernel, build(kernel), x, sample.shape[0]))

    def probe(kernels: Sequence[str]) -> dict[str, Accuracy]:
        return probe_projections({kernel: build(kernel) for kernel in kernels}, sample, quantized)

    shape = {"format": format or "float", "out": weight.shape[0], "in": weight.shape[1], "rows": rows}
    choice = CHOICES.choose(weight.dtype, shape, list(builders), timer, threads=torch.get_num_threads(),
                            unavailable=unavailable, probe=probe)

    def winner() -> Kernel:
        if sample.shape[0] == weight.shape[0]:
            return packed.get(choice.winner) or builders[choice.winner]()
        packed.clear()  # the sample's copies go before the whole weight is packed
        if choice.winner in FLOAT_KERNELS:
            return PackedLinear(weight, choice.winner)
        return QuantLinear(quantize(weight, format), choice.winner, weight.dtype)

    return choice, winner


def probe_projections(linears: dict[str, Kernel], weight: torch.Tensor,
                      quantized: QuantizedWeight | None) -> dict[str, Accuracy]:
    """Each kernel's accuracy on PROBE_ROWS rows (quant_kernels.probe_rows): its relative error against the float64
    product with `weight`, or with `quantized` dequantized for a quantized kernel, and the bound of its kind and the
    weight's dtype."""
    x = quant_kernels.probe_rows(PROBE_ROWS, weight.shape[1], weight.dtype)
    exact = x.double() @ weight.double().T
    dequantized = x.double() @ quantized.dequantize().double().T if quantized is not None else None
    accuracy = {}
    for kernel, linear in linears.items():
        y = multiply(kernel, linear, x, weight.shape[0])
        if isinstance(linear, QuantLinear):
            accuracy[kernel] = Accuracy(relative_error(y, dequantized), quant_kernels.bound(kernel, weight.dtype))
        else:
            accuracy[kernel] = Accuracy(relative_error(y, exact), error_bound(weight.dtype))
    return accuracy


def projection_for(linear: nn.Linear, experts_format: str | None, rows: int = ROWS) -> ProjectionLinear | None:
    """`linear` run by the kernel fastest here on `rows` rows, float or in the format `projection_format` allows
    beside experts in `experts_format` (None: float only): the one another runtime already built, if it still holds,
    else a new one; None where plain torch is fastest (the Linear then stays)."""
    format = projection_format(experts_format)
    held = getattr(linear, "_npumoe_projections", {}).get(format)
    projection = held() if held is not None else None
    if projection is not None and projection.packed_from(linear):
        return projection
    owned = getattr(linear, "_npumoe_owned", None)
    if owned is not None:
        raise ValueError(f"a {linear.in_features}→{linear.out_features} projection's weight was released when the "
                         f"engine packed it ({owned.format or 'float'}), so it cannot be packed "
                         f"{format or 'float'} now; load the model again")
    weight = linear.weight.detach()
    if weight.device.type != "cpu":  # the CPU's kernels only
        return None
    choice, build = choose_projection(weight, format, rows)
    if choice.winner == "torch":
        return None
    projection = ProjectionLinear(linear, build(), choice.winner,
                                  format if choice.winner in quant_kernels.KERNELS.get(format, ()) else None)
    linear._npumoe_projections = {**getattr(linear, "_npumoe_projections", {}), format: ref(projection)}
    return projection


def dense_projections(model: nn.Module) -> list[tuple[str, Slot]]:
    """Every dense projection of the model (see the module's docstring), by qualified name, whether the
    model holds the original Linear or an engine projection in its place now."""
    experts = [name for name, _, _ in expert_layouts(model)]
    blocks = {name.rpartition(".")[0] for name in experts}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    found = []
    for name, module in model.named_modules():
        linear = module.original if isinstance(module, ProjectionLinear) else module
        parent, _, leaf = name.rpartition(".")
        if (type(linear) is not nn.Linear or linear is head or parent in blocks
                or any(name.startswith(f"{e}.") for e in experts)):
            continue  # a subclass of Linear may compute something else: only plain ones are taken
        found.append((name, Slot(model.get_submodule(parent), leaf, linear)))
    return found


def _head_slot(model: nn.Module) -> Slot | None:
    """Where the model's LM head sits, when it is a plain Linear (held as it is or in `HeadRows`)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = head.original if isinstance(head, HeadRows) else head
    if type(head) is not nn.Linear:
        return None
    for name, module in model.named_modules():
        if name and (module is head or (isinstance(module, HeadRows) and module.original is head)):
            parent, _, leaf = name.rpartition(".")
            return Slot(model.get_submodule(parent), leaf, head)
    return None


class DenseProjections(SlotSwaps):
    """The model's dense projections that run faster through the engine's kernels, quantized where that measures
    faster (int8 beside int8 or int4 experts; `format` None: float only), and its LM head likewise, chosen on a
    decode step's one row (`_head`)."""

    def __init__(self, model: nn.Module, format: str | None = None, *, release: bool = False) -> None:
        self.slots: list[tuple[Slot, nn.Module]] = []
        for _, slot in dense_projections(model):
            projection = projection_for(slot.original, format)
            if projection is None:
                continue
            if release:
                release_weights(slot.original, ("weight",), projection)
            self.slots.append((slot, projection))
        if (head := _head_slot(model)) is not None:
            self.slots.append((head, _head(model, head.original, format, release)))


def _head(model: nn.Module, head: nn.Linear, format: str | None, release: bool) -> nn.Module:
    """The LM head run by the kernel fastest here on one decode step's row, in the format the projections take
    (int8 at most); `HeadRows` where plain torch is fastest. Its weight is released only when the input embedding
    does not share it (a tied embedding still reads it)."""
    projection = projection_for(head, format, HEAD_ROWS)
    if projection is None:
        return HeadRows(head)
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = isinstance(embedding, nn.Embedding) and embedding.weight.data_ptr() == head.weight.data_ptr()
    if release and not tied:
        release_weights(head, ("weight",), projection)
    return projection
