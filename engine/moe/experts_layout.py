"""What one experts module computes and how it stores its weights, read off the module once.

transformers 5 marks an experts class with `use_experts_implementation(...)`, whose flags (has_gate, has_bias,
is_transposed, is_concatenated, has_post_expert_norm) and the class's `_apply_gate` and `act_fn` define each
expert's FFN:

    h = x·W_upᵀ (+ b_up)   a = gate(h) when gated, act(h) when not   y = a·W_downᵀ (+ b_down)   y = post_norm(y)

`read_layout` turns a module into an `ExpertsLayout`. The gate and the activation are recognised by what they
compute, not by a class name: the module's own `_apply_gate` and `act_fn` run on a probe, and the first gate
the engine implements that gives the same values is the one. `expert_weights` gives the weights in the one form
every engine path reads (`ExpertWeights`: (E, out, in), gate rows before up rows), so the CPU experts, the
group graphs and the Core ML conversion differ only in what `ExpertsLayout.activate` and the biases add.
A module the engine cannot run raises `LayoutError`, one line naming the module, its class and what is missing.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache

import torch
from torch import nn
from transformers.activations import ACT2CLS, ACT2FN
from transformers.integrations.moe import _default_apply_gate

from .release import is_placeholder

# The gating functions the engine implements, on gate g and up u (the two halves of h):
GLU = "glu"  # act(g) * u: transformers' default `_apply_gate`
CLAMPED_GLU = "clamped-glu"  # act(min(g, limit)) * clamp(u, ±limit) (DeepSeek-V4, Hunyuan)
CLAMPED_SWIGLU = "clamped-swiglu"  # g' = min(g, limit): g'·σ(alpha·g') · (clamp(u, ±limit) + 1) (gpt-oss)
GATES = (GLU, CLAMPED_GLU, CLAMPED_SWIGLU)

# Activations coremltools converts from the exported graph to ops the Neural Engine runs (each checked by
# tests/coreml/test_grouped_layouts.py); experts with another stay on the CPU.
COREML_ACTIVATIONS = frozenset({"silu", "swish", "gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh",
                                "quick_gelu", "relu", "relu2", "relu6", "sigmoid", "tanh"})

_PROBE_WIDTH = 64  # probe columns per half
_PROBE_ROWS = 8

_ACTIVATION_NOTICES = logging.getLogger("transformers.activations")


class LayoutError(ValueError):
    """An experts module whose layout the engine does not implement."""


@dataclass(frozen=True)
class ExpertsLayout:
    """One experts module's FFN (gate, activation, biases, post-expert norm) and its weights' storage."""

    activation: str | None = "silu"  # transformers' name (ACT2FN) of the activation; None when the gate has none
    gate: str | None = GLU  # one of GATES; None: not gated, a = act(h)
    alpha: float | None = None  # CLAMPED_SWIGLU's sigmoid scale
    limit: float | None = None  # the clamp of the clamped gates
    bias: bool = False  # both projections add a per-expert bias
    post_norm: bool = False  # the module's `post_expert_norm` normalises each expert's output
    transposed: bool = False  # stored (E, in, out), not (E, out, in)
    interleaved: bool = False  # stored gate and up rows alternating, not gate half then up half

    def activate(self, gate: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor:
        """The FFN's intermediate values from the input projection's gate and up parts (gate None when not gated)."""
        if self.gate is None:
            return activation(self.activation)(up)
        if self.gate == GLU:
            return activation(self.activation)(gate) * up
        gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        if self.gate == CLAMPED_GLU:
            return activation(self.activation)(gate) * up
        return gate * torch.sigmoid(gate * self.alpha) * (up + 1)

    def apply(self, h: torch.Tensor) -> torch.Tensor:
        """(…, n·I) input projection -> (…, I), h holding the gate half before the up half when gated."""
        return self.activate(*h.chunk(2, dim=-1)) if self.gate is not None else self.activate(None, h)

    @property
    def projections(self) -> int:
        """Rows of the input projection per intermediate unit: 2 (gate and up) or 1 (up)."""
        return 2 if self.gate is not None else 1

    @property
    def weight_names(self) -> tuple[str, str]:
        """The module's names of its input and down projections' weights."""
        return ("gate_up_proj" if self.gate is not None else "up_proj", "down_proj")

    def describe(self) -> str:
        """A short description, e.g. "silu glu" or "clamped-swiglu(alpha=1.702, limit=7.0), biases"."""
        if self.gate is None:
            parts = [f"{self.activation}, not gated"]
        elif self.gate == CLAMPED_SWIGLU:
            parts = [f"{self.gate}(alpha={self.alpha}, limit={self.limit})"]
        else:
            parts = [f"{self.activation} {self.gate}" + (f"(limit={self.limit})" if self.gate == CLAMPED_GLU else "")]
        parts += [name for name, on in (("biases", self.bias), ("post-expert norm", self.post_norm)) if on]
        return ", ".join(parts)

    def coreml_problem(self) -> str | None:
        """Why these experts cannot go into Core ML group graphs; None when they can."""
        if self.activation is not None and self.activation not in COREML_ACTIVATIONS:
            return f"the {self.activation} activation is not one the Core ML conversion is checked for"
        return None


@cache
def activation(name: str) -> nn.Module:
    """transformers' activation called `name` (one shared instance: they hold no state). Making one may log a
    notice meant for a model that uses it (xIELU's, that its CUDA kernel is not installed, with a pip command):
    the engine makes them all to recognise a model's activation, so their notices are not the person's."""
    level = _ACTIVATION_NOTICES.level
    _ACTIVATION_NOTICES.setLevel(logging.ERROR)
    try:
        return ACT2FN[name]
    finally:
        _ACTIVATION_NOTICES.setLevel(level)


DEFAULT_LAYOUT = ExpertsLayout()  # transformers' default: fused gate-up, silu GLU, no biases


@dataclass(frozen=True, eq=False)  # tensors: compared by identity, never by value
class ExpertWeights:
    """E experts' weights in the engine's form. `gate_up` (E, n·I, H) holds the gate rows then the up rows
    (n = 2), or the up rows alone when not gated (n = 1); `down` (E, H, I); biases (E, n·I) and (E, H) or None.
    `source`: the module tensors they were read from (themselves by default), to tell when those change."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    source: tuple[torch.Tensor, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.gate_up.ndim != 3 or self.down.ndim != 3 or len(self.gate_up) != len(self.down):
            raise ValueError(f"expected (E, n·I, H) and (E, H, I) weights, got {tuple(self.gate_up.shape)} "
                             f"and {tuple(self.down.shape)}")
        if not self.source:
            object.__setattr__(self, "source", (self.gate_up, self.down))

    def __len__(self) -> int:
        return len(self.gate_up)

    @property
    def hidden(self) -> int:
        return self.down.shape[1]

    @property
    def ffn(self) -> int:
        return self.down.shape[2]

    def select(self, experts: Sequence[int]) -> ExpertWeights:
        """These experts' weights only, in the order given. Released weights (placeholders: the values live packed)
        give placeholders of the selection's shape, not a copy of a placeholder's zeros as large as the weights."""
        index = list(experts)
        return ExpertWeights(*(None if w is None else _selected(w, index) for w in self.tensors()))

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        return self.gate_up, self.down, self.gate_up_bias, self.down_bias

    def to(self, dtype: torch.dtype) -> ExpertWeights:
        return ExpertWeights(*(None if w is None else w.to(dtype) for w in self.tensors()))


def is_experts_module(module: nn.Module) -> bool:
    """Whether a module holds routed experts: transformers' experts interface marks it, or it keeps one 3-D
    weight per expert itself (an experts class transformers has not wrapped, which `read_layout` refuses)."""
    if hasattr(module, "has_gate") and hasattr(module, "down_proj"):
        return True
    experts = getattr(module, "num_experts", None)
    return isinstance(experts, int) and any(p.ndim == 3 and p.shape[0] == experts
                                            for _, p in module.named_parameters(recurse=False))


def read_layout(name: str, module: nn.Module) -> ExpertsLayout:
    """The layout of experts module `module` (at `name` in its model); `LayoutError` if the engine cannot run it."""
    where = f"{name} ({type(module).__name__})"
    if not hasattr(module, "has_gate"):
        raise LayoutError(f"{where}: not wrapped by transformers' experts interface (use_experts_implementation), "
                          "so the engine cannot run its experts without patching model code")
    if getattr(module, "_is_expert_parallel", False):
        raise LayoutError(f"{where}: expert-parallel experts (sharded over devices) are not implemented")
    up_name = "gate_up_proj" if module.has_gate else "up_proj"
    for weight in (up_name, "down_proj"):
        if not isinstance(getattr(module, weight, None), torch.Tensor) or getattr(module, weight).ndim != 3:
            raise LayoutError(f"{where}: needs a 3-D {weight} (one matrix per expert), has none")
    if module.has_bias and not all(isinstance(getattr(module, f"{w}_bias", None), torch.Tensor)
                                   for w in (up_name, "down_proj")):
        raise LayoutError(f"{where}: declares biases but has no {up_name}_bias and down_proj_bias")
    if module.has_post_expert_norm and not isinstance(getattr(module, "post_expert_norm", None), nn.Module):
        raise LayoutError(f"{where}: declares a post-expert norm but has no post_expert_norm module")
    storage = dict(bias=bool(module.has_bias), post_norm=bool(module.has_post_expert_norm),
                   transposed=bool(module.is_transposed))
    activation = _activation_name(module)
    if not module.has_gate:
        if activation is None:
            raise LayoutError(f"{where}: its activation {_act_class(module)} is not one of transformers' named "
                              "activations the engine runs")
        return ExpertsLayout(activation=activation, gate=None, **storage)
    gate = _recognise_gate(module, activation)
    if gate is None:
        raise LayoutError(f"{where}: its _apply_gate (activation {_act_class(module)}) computes a gating function "
                          f"the engine does not implement (it implements {', '.join(GATES)})")
    return ExpertsLayout(**gate, **storage)


def expert_weights(module: nn.Module, layout: ExpertsLayout) -> ExpertWeights:
    """The module's experts' weights in the engine's form: views of the module's tensors, except where the
    stored gate and up rows alternate (then a reordered copy)."""
    up_name = layout.weight_names[0]
    biases = (getattr(module, f"{up_name}_bias").detach(), module.down_proj_bias.detach()) if layout.bias else ()
    return engine_form(layout, getattr(module, up_name).detach(), module.down_proj.detach(), *biases,
                       source=(getattr(module, up_name), module.down_proj))


def engine_form(layout: ExpertsLayout, gate_up: torch.Tensor, down: torch.Tensor,
                gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                source: tuple[torch.Tensor, ...] = ()) -> ExpertWeights:
    """Experts' weights as a module of `layout` stores them (E first), in the engine's form."""
    if layout.transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    if layout.interleaved and not is_placeholder(gate_up):  # a placeholder's rows are all one value: no reorder
        gate_up = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)
        gate_up_bias = None if gate_up_bias is None else torch.cat([gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]], 1)
    return ExpertWeights(gate_up, down, gate_up_bias, down_bias, source=source)


def _selected(weight: torch.Tensor, index: list[int]) -> torch.Tensor:
    if is_placeholder(weight):
        return weight[:1].expand(len(index), *weight.shape[1:])
    return weight[index]


def _act_class(module: nn.Module) -> str:
    act = getattr(module, "act_fn", None)
    return type(act).__name__ if act is not None else "none"


def _probe(width: int, scale: float = 4.0) -> torch.Tensor:
    """Probe values spanning the range activations and clamps act on, the same on every call."""
    return torch.randn(_PROBE_ROWS, width, generator=torch.Generator().manual_seed(0)) * scale


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and torch.allclose(got.float(), want.float(), rtol=1e-5, atol=1e-6)


@torch.no_grad()
def _activation_name(module: nn.Module) -> str | None:
    """The ACT2FN name whose function equals the module's `act_fn` on a probe (the config's own name first);
    None when it has none or no named activation matches (learned ones never count: they hold weights)."""
    act = getattr(module, "act_fn", None)
    if not callable(act) or (isinstance(act, nn.Module) and any(True for _ in act.parameters())):
        return None
    x = _probe(_PROBE_WIDTH)
    try:
        want = act(x)
    except Exception:  # an activation that cannot run on its own: one the engine does not know
        return None
    return next((name for name in _named_activations(module) if _same(activation(name)(x), want)), None)


def _named_activations(module: nn.Module) -> list[str]:
    """transformers' parameter-free named activations, the one the module's config names first."""
    config = getattr(module, "config", None)
    configured = [getattr(config, key, None) for key in ("hidden_act", "hidden_activation")]
    names = [name for name in configured if isinstance(name, str) and name in ACT2CLS]
    stateless = (name for name in ACT2CLS if not any(True for _ in activation(name).parameters()))
    return list(dict.fromkeys([*names, *stateless]))


@torch.no_grad()
def _recognise_gate(module: nn.Module, activation: str | None) -> dict | None:
    """The ExpertsLayout fields (gate, activation, alpha, limit, interleaved) of the engine's gate equal to the
    module's `_apply_gate` on a probe; None when none is. A gate that calls its activation directly, without
    an `act_fn`, is matched against each named activation."""
    alpha = _number(module, "alpha", "swiglu_alpha")
    limit = _number(module, "limit", "swiglu_limit")
    activations = [activation] if activation is not None else _named_activations(module)
    candidates = [dict(gate=GLU, activation=name) for name in activations]
    if limit is not None:
        candidates += [dict(gate=CLAMPED_GLU, activation=name, limit=limit) for name in activations]
        if alpha is not None:
            candidates.append(dict(gate=CLAMPED_SWIGLU, activation=None, alpha=alpha, limit=limit))
    if type(module)._apply_gate is _default_apply_gate:
        candidates = candidates[:1]  # transformers' own: act(first half) * second half, nothing else
    scale = 2 * limit if limit is not None and math.isfinite(limit) else 4.0  # reach past the clamps
    h = _probe(2 * _PROBE_WIDTH, scale)
    try:
        want = module._apply_gate(h.clone())
    except Exception:  # a gate that needs more than the module holds: not one the engine can read
        return None
    for fields in candidates:
        for interleaved in (False, True):
            halves = torch.cat([h[:, 0::2], h[:, 1::2]], dim=1) if interleaved else h
            if _same(ExpertsLayout(**fields).apply(halves), want):
                return {**fields, "interleaved": interleaved}
    return None


def _number(module: nn.Module, *names: str) -> float | None:
    """The first of these attributes the module has as a number."""
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return None
