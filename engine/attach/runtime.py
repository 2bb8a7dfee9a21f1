"""Attaching the engine to a loaded model through transformers' experts interface.

transformers wraps every experts class it can swap out with `use_experts_implementation`: the wrapped
`forward` looks up the model's current experts implementation (`config._experts_implementation`) in the
`ExpertsInterface` registry `ALL_EXPERTS_FUNCTIONS` and calls what is registered under that name. This
module registers `experts_forward` there as "npumoe"; `MoeRuntime.attach` selects it with
`set_experts_implementation` and puts `(runtime, layer)` on each experts module as `_npumoe_attached`.
So one experts call takes this path:

    experts module's forward (transformers) -> `experts_forward` (here) -> the module's `MoeRuntime`
    -> its `MoeLayer` (dispatch.py): planned groups on the backend, every other expert on the exact CPU path

The model's own router still runs: the layer gets (hidden (T, H), top_k_index (T, k), top_k_weights (T, k)).
Model code is not patched; detaching restores the implementation the model had.

A dense model (no experts module: its FFN is one expert every token takes) gets a runtime with no layers: its
attention, projections (the FFN's among them) and norms run through the engine as an MoE model's do, and there is
nothing for a plan or a static backend's group graphs to place (`dense_refusal`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from weakref import ref

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from ..backends.base import Backend, GroupSpec
from ..errors import ModelError
from ..moe.cpu_experts import CpuExperts, held_packed
from ..moe.dispatch import DispatchStats, MoeLayer, StaticGroup
from ..moe.experts_layout import GLU, ExpertsLayout, ExpertWeights, expert_weights
from ..moe.model_experts import expert_layouts
from ..moe.release import release_weights, released
from ..plan.expert_plan import ExpertPlan, LayerPlan, PlanError
from ..plan.residency import Placement, Residency, decide_residency
from ..vocabulary import SPILL
from .attention import use_engine_attention
from .norms import EngineNorms
from .projections import DenseProjections
from .slots import NoSwaps

IMPLEMENTATION = "npumoe"

log = logging.getLogger(__name__)


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """What transformers calls for an experts module while "npumoe" is selected: the attached runtime's layer."""
    attached = _attached(self)
    if attached is None:
        raise RuntimeError(f"experts implementation {IMPLEMENTATION!r} is selected, but this "
                           f"{type(self).__name__} is not attached to an engine runtime (use MoeRuntime)")
    runtime, layer = attached
    if runtime.exact_only:
        return layer.exact(hidden_states, top_k_index, top_k_weights)
    return layer(hidden_states, top_k_index, top_k_weights, runtime.stats)


ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, experts_forward)


class MoeRuntime:
    """One `MoeLayer` per experts module of `model`, built from the plan's groups on `backend`.

    `residency` (decided for this backend, `placement.place`) says which groups run as graphs, at which
    capacity; without one, every group calibration saw load for does. Without a plan every expert runs on
    the exact CPU path. `quantized` ("int8", "int4"): the CPU experts run quantized weights (their result is
    then approximate); torch-static group graphs stay float, Core ML ones run packages compressed alike.
    `release`: once the CPU experts have packed a module's weights, the module's own expert tensors are freed,
    leaving one copy: the model's experts then run only through a runtime (the eager implementation has nothing
    left to read), and no later runtime can build group graphs or another format from them. Dispatch counts
    accumulate in `stats` for prefill (in another `DispatchStats` inside `counting()`); inside `decoding()` layers
    run exact and uncounted (one token per step). The model's dense projections outside the experts (attention's,
    dense FFNs', shared experts') run through the engine's measured kernels while attached, quantized (int8 at
    most) where that measures faster (projections.py; `release` frees their own weights too), and its RMSNorms
    through the engine's norm kernel where it runs here (norms.py). A new runtime is attached; several runtimes of
    one model may be built, and `attach()` selects which one runs. Without `projections`, the model's own dense
    projections run (no packed copy of them is made: what measuring the experts' loads needs).
    """

    def __init__(self, model: PreTrainedModel, backend: Backend, plan: ExpertPlan | None = None,
                 overflow: str = SPILL, residency: Residency | None = None, *, quantized: str | None = None,
                 release: bool = False, projections: bool = True) -> None:
        experts = expert_layouts(model)
        if not experts and (why := dense_refusal(model, backend.name, backend.static, plan is not None)):
            raise ModelError(why)
        if backend.static and plan is None:
            raise ValueError(f"the {backend.name} backend runs planned groups: give it a plan (npumoed calibrate)")
        plans = _layer_plans(plan, experts)
        placed = {}
        if plan is not None:  # without measured costs, every group calibration saw load for runs as a graph
            residency = residency or decide_residency(plan, backend)
            placed = {layer.name: p for layer, p in zip(plan.layers, residency.layers, strict=True)}
        self.model = model
        self.stats = DispatchStats()
        self.exact_only = False
        self.layers: list[MoeLayer] = []
        for (name, module, layout), layer_plan in zip(experts, plans, strict=True):
            weights = expert_weights(module, layout)
            resident = [(group, placement) for group, placement in zip(layer_plan.groups, placed[layer_plan.name],
                                                                       strict=True)
                        if placement.accelerator] if layer_plan else []
            if resident and (problem := backend.static_problem(layout)) is not None:
                log.warning("%s: its experts run on the CPU, not in %s group graphs: %s", name, backend.name, problem)
                resident = []
            if layout.gate != GLU and any(placement.scale != 1.0 for _, placement in resident):
                log.warning("%s: groups beyond fp16 range run on the CPU: a %s layout cannot be scaled", name,
                            layout.describe())
                resident = [(group, placement) for group, placement in resident if placement.scale == 1.0]
            if resident and backend.graphs_from_float and released(module):
                raise ValueError(f"{name}: its expert weights were released when the engine packed them, so no "
                                 f"{backend.name} group graphs can be built from them; load the model again")
            cpu = _cpu_experts(module, weights, layout, quantized)
            groups = [_static_group(backend, weights, layout, cpu, group.experts, placement)
                      for group, placement in resident]
            if release:
                release_weights(module, layout.weight_names, cpu)
            self.layers.append(MoeLayer(weights, layout, groups=groups, overflow=overflow, submit=backend.submit,
                                        experts=cpu, post_norm=module.post_expert_norm if layout.post_norm else None))
        self.names = [name for name, _, _ in experts]
        self._experts = [module for _, module, _ in experts]
        self._projections = DenseProjections(model, quantized, release=release) if projections else NoSwaps()
        self._norms = EngineNorms(model)
        self.attach()

    def attach(self) -> None:
        """Run the model's experts through this runtime's layers, in place of any other runtime's, its dense
        projections and norms through this runtime's kernels, and its attention through the engine's where that computes
        the same (attention.py)."""
        running = self._running()
        if running is self:
            return
        # what the model ran before the engine, whichever runtime took it over first
        if running is not None:
            self._previous, self._previous_attention = running._previous, running._previous_attention
        else:
            self._previous = self.model.get_experts_implementation()
            self._previous_attention = use_engine_attention(self.model)  # None: the model's own attention stays
        for module, layer in zip(self._experts, self.layers, strict=True):
            module._npumoe_attached = (self, layer)
        self.model._npumoe_runtime = self
        if self._experts:  # a dense model has no experts implementation to select
            self.model.set_experts_implementation(IMPLEMENTATION)
        if running is not None:  # its projections and norms out, whichever of them this runtime does not replace
            running._projections.detach()
            running._norms.detach()
        self._projections.attach()
        self._norms.attach()

    def detach(self) -> None:
        """Give the model back the experts implementation, the projections and the norms it had before the engine
        (if this runtime runs)."""
        if self._running() is not self:
            return
        for module in self._experts:
            del module._npumoe_attached
        del self.model._npumoe_runtime
        self._projections.detach()
        self._norms.detach()
        if self._experts:
            self.model.set_experts_implementation(self._previous)
        if self._previous_attention is not None:
            self.model.set_attn_implementation(self._previous_attention)

    def _running(self) -> MoeRuntime | None:
        """The runtime the model runs through now (a dense model's as well as an MoE model's)."""
        return getattr(self.model, "_npumoe_runtime", None)

    @contextmanager
    def decoding(self) -> Iterator[None]:
        """Decode steps run every expert exactly on the CPU and leave `stats` alone."""
        self.exact_only = True
        try:
            yield
        finally:
            self.exact_only = False

    @contextmanager
    def counting(self, stats: DispatchStats) -> Iterator[None]:
        """Prefill's dispatch counts go to `stats` inside the block, and back to where they went before after it.
        Blocks nest: a search query embedded between a document's chunks counts into its own, not the document's."""
        outer, self.stats = self.stats, stats
        try:
            yield
        finally:
            self.stats = outer

    @contextmanager
    def recording_loads(self) -> Iterator[list[list[torch.Tensor]]]:
        """Collect each layer's (E,) token counts per call: yields one list per layer."""
        for layer in self.layers:
            layer.loads = []
        try:
            yield [layer.loads for layer in self.layers]
        finally:
            for layer in self.layers:
                layer.loads = None


def dense_refusal(model: nn.Module, backend: str, static: bool, planned: bool) -> str | None:
    """Why a dense model (no experts modules) cannot run with a plan or on a static backend, in one line; None
    when it runs as asked (no plan, a backend that runs the CPU path)."""
    if not (planned or static):
        return None
    asked = "an expert plan" if planned else f"the {backend} backend, which runs planned expert groups as graphs,"
    return (f"{type(model).__name__} is a dense model: {asked} has no experts to place in it (its FFN is one "
            f"expert every token takes, run on the CPU path); run it without a plan on the cpu backend")


def _attached(module: nn.Module) -> tuple[MoeRuntime, MoeLayer] | None:
    """(runtime, layer) that an experts module runs through, set by `MoeRuntime.attach`; None when detached."""
    return getattr(module, "_npumoe_attached", None)


def released_format(model: nn.Module) -> str | None:
    """The quantized format ("int8", "int4") the model's experts were packed in when their own weights were released
    (by the loader or a runtime); None when they were packed float or are still the module's."""
    formats = {module._npumoe_owned.format for _, module, _ in expert_layouts(model) if released(module)}
    return formats.pop() if len(formats) == 1 else None


def _cpu_experts(module: nn.Module, weights: ExpertWeights, layout: ExpertsLayout,
                 quantized: str | None) -> CpuExperts:
    """The module's experts packed for the CPU in the format `quantized` (None: float): the copy another runtime
    already holds, if its weights are still the ones it packed in that format, else a new one. The module keeps
    only a weak reference (`_npumoe_packed`), so the copy goes when the last runtime using it does."""
    experts = held_packed(module, weights, quantized)
    if experts is None:
        if released(module):
            raise ValueError(f"{type(module).__name__}: its expert weights were released when the engine packed "
                             f"them ({module._npumoe_owned.format or 'float'}), so they cannot be packed "
                             f"{quantized or 'float'} now; load the model again")
        experts = CpuExperts(weights, layout, quantized)
        module._npumoe_packed = ref(experts)
    return experts


def _static_group(backend: Backend, weights: ExpertWeights, layout: ExpertsLayout, cpu: CpuExperts,
                  ids: tuple[int, ...], placement: Placement) -> StaticGroup:
    """The backend's graph for experts `ids` of one experts module, at the placement's capacity and scale: over the
    packed copy `cpu` the CPU path reads, or from the float weights where the backend's graphs hold their own."""
    spec = GroupSpec(weights.select(ids), layout, placement.capacity, placement.scale, packed=(cpu, ids))
    return StaticGroup(experts=ids, capacity=placement.capacity, graph=backend.build_spec(spec))


def _layer_plans(plan: ExpertPlan | None,
                 experts: list[tuple[str, nn.Module, ExpertsLayout]]) -> list[LayerPlan | None]:
    """The plan's layers in the model's experts order, checked against the model's shapes."""
    if plan is None:
        return [None] * len(experts)
    by_name = {layer.name: layer for layer in plan.layers}
    names = [name for name, _, _ in experts]
    if set(by_name) != set(names):
        raise PlanError(f"the plan's MoE layers do not match the model's (plan: {len(by_name)} layers, "
                        f"model: {len(names)}; first difference: {sorted(set(by_name) ^ set(names))[0]})")
    for name, module, _ in experts:
        if by_name[name].num_experts != module.num_experts:
            raise PlanError(f"{name}: the plan has {by_name[name].num_experts} experts, "
                            f"the model {module.num_experts}")
    return [by_name[name] for name in names]
