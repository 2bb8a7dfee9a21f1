"""Placing a plan on a backend here: measure the backend's costs for the plan, cache them, decide residency.

Costs are measured once per backend, machine and plan and kept in a `CostCache` (the daemon's is its
home's `costs/`), so a daemon start reads them instead of timing again. A backend with a device of
its own also times each compiled group graph there and reads where its ops run; those figures go into
the same file, with the groups whose graphs the accuracy gate refused (`graph_check.py`) and why. A
backend whose graphs run through torch here (Core ML off macOS) is measured as torch runs them, and
says so: its residency is decided again where its device exists.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from ..moe.cpu_experts import CpuExperts, held_packed
from ..moe.experts_layout import ExpertsLayout, ExpertWeights, expert_weights
from ..moe.model_experts import moe_layouts
from ..plan.cost_cache import CostCache, machine
from ..plan.expert_plan import ExpertPlan
from ..plan.residency import MeasuredCosts, Residency, decide_residency, group_key
from ..vocabulary import ACCELERATOR, DTYPE_WEIGHTS, MEASURED, QUANTIZED, TORCH_STATIC
from .base import Backend, GroupSpec
from .graph_check import graph_refusal


def plan_experts(plan: ExpertPlan, model: nn.Module) -> list[tuple[ExpertWeights, ExpertsLayout]]:
    """The model's experts weights (in the engine's form) and layout for each plan layer, in plan order."""
    return [(weights, layout) for weights, layout, _ in _plan_modules(plan, model)]


def _plan_modules(plan: ExpertPlan, model: nn.Module) -> list[tuple[ExpertWeights, ExpertsLayout, nn.Module]]:
    modules = {name: (module, layout) for name, module, layout in moe_layouts(model)}
    missing = [layer.name for layer in plan.layers if layer.name not in modules]
    if missing:
        raise ValueError(f"the model has no MoE layer {missing[0]}, which the plan names")
    return [(expert_weights(*modules[layer.name]), modules[layer.name][1], modules[layer.name][0])
            for layer in plan.layers]


def conditions(model: nn.Module, plan: ExpertPlan, weights: str | None) -> dict[str, str]:
    """What costs measured now depend on besides the machine: the experts' dtype, the run's weights format (its
    quantized format, else the dtype's own, however it was asked for) and the torch threads they run on."""
    dtype = str(plan_experts(plan, model)[0][0].down.dtype).removeprefix("torch.")
    return {"dtype": dtype, "weights": weights if weights in QUANTIZED else DTYPE_WEIGHTS.get(dtype, dtype),
            "threads": str(torch.get_num_threads())}


@torch.inference_mode()
def measure(plan: ExpertPlan, backend: Backend, model: nn.Module, weights: str | None = None) -> MeasuredCosts:
    """Time `backend`'s graphs and the exact CPU path at the model's expert geometry, and each group graph the
    backend can time on its device (every group calibration saw load for); how many experts its device has
    room for, where it holds their weights; and which groups' graphs the accuracy gate refuses (it probes every
    group the backend can build, so that either policy places only graphs that passed)."""
    experts = _experts_for_graphs(plan, backend, model, weights)
    first = experts[0][0]
    hidden, ffn = first.hidden, first.ffn
    cost = backend.measure_costs(hidden, ffn, first.down.dtype, plan.group_size)
    timed = dict(_specs(plan, backend, decide_residency(plan, backend), experts))
    # one group's spec at a time: one built from float weights holds a copy of them until its probe is done
    refused = {key: why for key, (spec, i, g) in _specs(plan, backend, decide_residency(plan, backend,
                                                                                         policy=ACCELERATOR), experts)
               if (why := graph_refusal(backend, spec, plan.layers[i].magnitudes, plan.layers[i].groups[g].experts))}
    fallback = backend.fallback_reason()
    measured_on = f"{TORCH_STATIC if fallback else backend.name} on {machine()}"
    return MeasuredCosts(cost=cost, hidden=hidden, ffn=ffn, measured_on=measured_on,
                         groups=backend.time_groups({key: spec for key, (spec, _, _) in timed.items()}),
                         fallback=fallback, device_experts=backend.device_room(hidden, ffn, first.down.dtype),
                         refused=refused, conditions=conditions(model, plan, weights))


def _experts_for_graphs(plan: ExpertPlan, backend: Backend, model: nn.Module, weights: str | None,
                        ) -> list[tuple[ExpertWeights, ExpertsLayout, CpuExperts | None]]:
    """Each plan layer's experts weights and layout, with the packed copy the engine holds in the run's format where
    the backend builds its graphs over that copy (and they are then timed and probed as they will run)."""
    quantized = weights if weights in QUANTIZED else None
    return [(experts, layout, None if backend.graphs_from_float else held_packed(module, experts, quantized))
            for experts, layout, module in _plan_modules(plan, model)]


def _specs(plan: ExpertPlan, backend: Backend, residency: Residency,
           experts: list[tuple[ExpertWeights, ExpertsLayout, CpuExperts | None]],
           ) -> Iterator[tuple[str, tuple[GroupSpec, int, int]]]:
    """The graph of each group `residency` places on the accelerator (of a layout `backend` converts), with its plan
    layer and group, by group_key, made as it is asked for."""
    for i, (layer, placements) in enumerate(zip(plan.layers, residency.layers, strict=True)):
        for g, (group, placement) in enumerate(zip(layer.groups, placements, strict=True)):
            weights, layout, packed = experts[i]
            if placement.accelerator and backend.static_problem(layout) is None:
                yield group_key(i, g), (GroupSpec(weights.select(group.experts), layout, placement.capacity,
                                                  placement.scale, None if packed is None else (packed, group.experts)),
                                        i, g)


def place(plan: ExpertPlan, backend: Backend, model: nn.Module, cache: CostCache | None,
          policy: str = MEASURED, weights: str | None = None) -> Residency:
    """`plan`'s residency on `backend` here under `policy` (vocabulary.RESIDENCY_POLICIES) for a run in `weights`
    (None: the experts' dtype): from the cached costs when there are, measured with what this run uses (costs
    given without conditions, as a test does, are taken as they are), else measured now (and cached)."""
    if not backend.static:
        return decide_residency(plan, backend, policy=policy)
    costs = cache.get(backend.name, plan) if cache is not None else None
    if costs is None or (costs.conditions and costs.conditions != conditions(model, plan, weights)):
        costs = measure(plan, backend, model, weights)
        if cache is not None:
            cache.put(backend.name, plan, costs)
    return decide_residency(plan, backend, costs, policy)
