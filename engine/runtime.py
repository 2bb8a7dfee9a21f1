"""Attaching the engine to a loaded model through transformers' experts interface.

The engine registers one experts implementation, "npumoe", with `ALL_EXPERTS_FUNCTIONS` and selects
it with `set_experts_implementation`: the model's own router still runs, then every experts module
hands (hidden (T, H), top_k_index (T, k), top_k_weights (T, k)) to its `MoeLayer`. Model code is
not patched; detaching restores the implementation the model had.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from weakref import WeakKeyDictionary, ref

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from .backends import Backend
from .cpu_experts import CpuExperts
from .dispatch import DispatchStats, MoeLayer, StaticGroup
from .models import moe_experts
from .plan import ExpertPlan, LayerPlan, PlanError

IMPLEMENTATION = "npumoe"

# experts module -> (its runtime, its layer); weak, so a dropped model takes its entries with it.
_ATTACHED: WeakKeyDictionary[nn.Module, tuple[MoeRuntime, MoeLayer]] = WeakKeyDictionary()
# model -> the runtime its experts run through now.
_RUNNING: WeakKeyDictionary[PreTrainedModel, MoeRuntime] = WeakKeyDictionary()
# experts module -> its experts packed for the CPU, while a layer uses them: runtimes of one model share one copy.
_PACKED: WeakKeyDictionary[nn.Module, ref[CpuExperts]] = WeakKeyDictionary()


def _npumoe_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    if self not in _ATTACHED:
        raise RuntimeError(f"experts implementation {IMPLEMENTATION!r} is selected, but this "
                           f"{type(self).__name__} is not attached to an engine runtime (use MoeRuntime)")
    runtime, layer = _ATTACHED[self]
    if runtime.exact_only:
        return layer.exact(hidden_states, top_k_index, top_k_weights)
    return layer(hidden_states, top_k_index, top_k_weights, runtime.stats)


ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, _npumoe_experts_forward)


class MoeRuntime:
    """One `MoeLayer` per experts module of `model`, built from the plan's groups on `backend`.

    Without a plan every expert runs on the exact CPU path. Dispatch counts accumulate in `stats`
    for prefill; inside `decoding()` layers run exact and uncounted (one token per step). A new runtime
    is attached; several runtimes of one model may be built, and `attach()` selects which one runs.
    """

    def __init__(self, model: PreTrainedModel, backend: Backend, plan: ExpertPlan | None = None,
                 overflow: str = "spill") -> None:
        if backend.static and plan is None:
            raise ValueError(f"the {backend.name} backend runs planned groups: give it a plan (npumoed calibrate)")
        if plan is not None and plan.backend != backend.name:
            raise PlanError(f"the plan was made for the {plan.backend} backend, not {backend.name}: "
                            f"use that backend or calibrate for {backend.name}")
        experts = moe_experts(model)
        plans = _layer_plans(plan, experts)
        self.model = model
        self.stats = DispatchStats()
        self.exact_only = False
        self.layers: list[MoeLayer] = []
        for (_, module), layer_plan in zip(experts, plans, strict=True):
            groups = [_static_group(backend, module, group.experts, plan.tiers[group.tier])
                      for group in layer_plan.groups if group.residency == "accelerator"] if plan and layer_plan else []
            layer = MoeLayer(module.gate_up_proj, module.down_proj, module.config.hidden_act, groups=groups,
                             overflow=overflow, submit=backend.submit, experts=_cpu_experts(module))
            self.layers.append(layer)
        self.names = [name for name, _ in experts]
        self._experts = [module for _, module in experts]
        self.attach()

    def attach(self) -> None:
        """Run the model's experts through this runtime's layers, in place of any other runtime's."""
        running = _RUNNING.get(self.model)
        if running is self:
            return
        # what the model ran before the engine, whichever runtime took it over first
        self._previous = running._previous if running is not None else self.model.get_experts_implementation()
        for module, layer in zip(self._experts, self.layers, strict=True):
            _ATTACHED[module] = (self, layer)
        _RUNNING[self.model] = self
        self.model.set_experts_implementation(IMPLEMENTATION)

    def detach(self) -> None:
        """Give the model back the experts implementation it had before the engine (if this runtime runs)."""
        if _RUNNING.get(self.model) is not self:
            return
        del _RUNNING[self.model]
        for module in self._experts:
            _ATTACHED.pop(module, None)
        self.model.set_experts_implementation(self._previous)

    @contextmanager
    def decoding(self) -> Iterator[None]:
        """Decode steps run every expert exactly on the CPU and leave `stats` alone."""
        self.exact_only = True
        try:
            yield
        finally:
            self.exact_only = False

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


def _cpu_experts(module: nn.Module) -> CpuExperts:
    """The module's experts packed for the CPU: the copy another runtime already holds, if its weights are
    still the ones it packed, else a new one."""
    held = _PACKED.get(module)
    experts = held() if held is not None else None
    if experts is None or not experts.packed_from(module.gate_up_proj, module.down_proj):
        experts = CpuExperts(module.gate_up_proj, module.down_proj, module.config.hidden_act)
        _PACKED[module] = ref(experts)
    return experts


def _static_group(backend: Backend, experts: nn.Module, ids: tuple[int, ...], capacity: int) -> StaticGroup:
    """The backend's graph for experts `ids` of one experts module, at `capacity`."""
    index = list(ids)
    graph = backend.build_group(experts.gate_up_proj[index], experts.down_proj[index], experts.config.hidden_act,
                                capacity)
    return StaticGroup(experts=ids, capacity=capacity, graph=graph)


def _layer_plans(plan: ExpertPlan | None, experts: list[tuple[str, nn.Module]]) -> list[LayerPlan | None]:
    """The plan's layers in the model's experts order, checked against the model's shapes."""
    if plan is None:
        return [None] * len(experts)
    by_name = {layer.name: layer for layer in plan.layers}
    names = [name for name, _ in experts]
    if set(by_name) != set(names):
        raise PlanError(f"the plan's MoE layers do not match the model's (plan: {len(by_name)} layers, "
                        f"model: {len(names)}; first difference: {sorted(set(by_name) ^ set(names))[0]})")
    for name, module in experts:
        if by_name[name].num_experts != module.num_experts:
            raise PlanError(f"{name}: the plan has {by_name[name].num_experts} experts, "
                            f"the model {module.num_experts}")
    return [by_name[name] for name in names]
