"""Residency: which of a plan's groups run as static graphs on a backend, decided where the plan runs.

The plan says how busy each group was in calibration; the backend's costs, measured on this machine
(`placement.py` measures and caches them), say what one launch of a group's padded graph costs here
against running its experts on the exact CPU path. A group runs on the accelerator when its graph is
expected to cost no more; a compiled graph's own measured time, where the backend has one, replaces
the cost model's estimate for that group. Three more rules, for the backends they concern:

- capacity alignment: each tier's capacity is padded up to the multiple the backend declares (the
  Neural Engine reads its capacity axis in 64-byte steps, 32 fp16 values), never past the chunk length;
- fp16 range: on a backend that computes in fp16, a group whose calibrated values would overflow fp16
  runs scaled (its graph computes the values divided by a power of two, which the host multiplies back)
  or, where scaling cannot help (the gate projection alone overflows), on the CPU;
- placement: a group whose compiled graph Core ML would run mostly off the Neural Engine stays on the CPU;
- accuracy: a group whose graph the accuracy gate refused (`backends/graph_check.py`: wrong or not finite on a
  probe against the exact CPU path) stays on the CPU, whatever the policy;
- device memory: on a backend whose device holds its groups' weights (a GPU), the groups that save the most
  stay on it while their experts fit in the room it measured; the rest run on the CPU.

Under the `accelerator` policy every group the backend can build (in fp16's range, within its device's memory)
runs on it, idle or costly ones included: the planned path run end to end on any machine, to see it and test it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from ..vocabulary import ACCELERATOR, MEASURED
from .cost import CostModel
from .expert_plan import ExpertGroup, ExpertMagnitudes, ExpertPlan

FP16_MAX = 65504.0
# Calibration sees a sample of what a model meets: its largest values must stay this far under fp16's limit.
FP16_HEADROOM = 4.0
FP16_LIMIT = FP16_MAX / FP16_HEADROOM
MOSTLY_OFF = 0.5  # a group with more than this share of its ops off the Neural Engine stays on the CPU

# Why a group runs where it does.
CHEAPER = "cheaper"  # its measured or modelled cost is lower there
IDLE = "idle"  # calibration routed no token to its experts
FP16_RANGE = "fp16 range"  # its values overflow fp16 even scaled
PLACEMENT = "placement"  # Core ML places most of its ops off the Neural Engine
MEMORY = "device memory"  # its experts' weights do not fit beside the groups that save more
NO_GRAPHS = "no static graphs"  # the backend runs every expert on the CPU
UNMEASURED = "unmeasured"  # no costs measured yet: every group calibration saw load for is a candidate
ACCURACY = "accuracy"  # its graph computed something else than the exact CPU path on a probe
FORCED = "forced"  # the accelerator policy places every group the backend can build


class BackendTraits(Protocol):
    """What residency reads from a backend (its class is enough)."""

    name: str
    static: bool
    capacity_multiple: int
    fp16: bool


@dataclass(frozen=True)
class GroupMeasure:
    """A compiled group graph measured on the device: seconds per launch, and where Core ML places its ops."""

    seconds: float
    device_ops: int = 0  # its ops Core ML places on the Neural Engine
    ops: int = 0  # all its ops (0: not read)


@dataclass(frozen=True)
class MeasuredCosts:
    """What a backend measured on this machine for one plan (cached in the home per backend, machine and plan)."""

    cost: CostModel
    hidden: int  # the experts' sizes the costs were measured at
    ffn: int
    measured_on: str  # the backend whose graphs were timed, and the machine: "coreml on Apple M3 (Darwin arm64)"
    groups: dict[str, GroupMeasure] = field(default_factory=dict)  # by `group_key`
    fallback: str | None = None  # why the backend's graphs ran through torch instead of its device
    device_experts: int | None = None  # experts whose weights fit in the device's room (None: no limit)
    refused: dict[str, str] = field(default_factory=dict)  # by `group_key`: why the accuracy gate refused its graph
    # what they were measured with: the experts' dtype, the run's weights format, the torch threads (placement.py)
    conditions: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"cost": vars(self.cost), "hidden": self.hidden, "ffn": self.ffn, "measured_on": self.measured_on,
                "fallback": self.fallback, "groups": {key: vars(m) for key, m in self.groups.items()},
                "device_experts": self.device_experts, "refused": self.refused, "conditions": self.conditions}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MeasuredCosts:
        return cls(cost=CostModel(**data["cost"]), hidden=int(data["hidden"]), ffn=int(data["ffn"]),
                   measured_on=str(data["measured_on"]), fallback=data["fallback"],
                   groups={str(key): GroupMeasure(**m) for key, m in data["groups"].items()},
                   device_experts=data.get("device_experts"),
                   refused={str(key): str(why) for key, why in data.get("refused", {}).items()},
                   conditions={str(key): str(value) for key, value in data.get("conditions", {}).items()})


@dataclass(frozen=True)
class Placement:
    """Where one group of a plan runs on one backend, at which capacity, and scaled by how much."""

    accelerator: bool
    capacity: int  # the tier's capacity aligned for the backend
    scale: float  # its graph computes values / scale (a power of two; 1: unscaled)
    reason: str  # one of the reasons above


@dataclass(frozen=True)
class Residency:
    """A plan's groups placed for one backend: `layers[i][g]` is plan layer i's group g."""

    backend: str
    measured_on: str | None  # whose measured costs decided it; None: not measured (every loaded group a candidate)
    fallback: str | None
    layers: tuple[tuple[Placement, ...], ...]

    def placements(self) -> Iterator[Placement]:
        return (p for layer in self.layers for p in layer)

    @property
    def accelerator_groups(self) -> int:
        return sum(p.accelerator for p in self.placements())

    @property
    def cpu_groups(self) -> int:
        return sum(not p.accelerator for p in self.placements())


def group_key(layer: int, group: int) -> str:
    """How measured costs name plan layer `layer`'s group `group`."""
    return f"{layer}/{group}"


def key_group(key: str) -> tuple[int, int]:
    """(plan layer, group) a `group_key` names."""
    layer, group = key.split("/")
    return int(layer), int(group)


def aligned_capacity(capacity: int, multiple: int, chunk_tokens: int) -> int:
    """`capacity` padded up to a multiple of `multiple`, but never past the chunk (no expert gets more tokens)."""
    return min(-(-capacity // multiple) * multiple, max(capacity, chunk_tokens))


def fp16_scale(magnitudes: ExpertMagnitudes | None, experts: Sequence[int]) -> float | None:
    """The power of two a group's fp16 graph divides its values by (1: none needed), or None when scaling cannot
    keep them in range. A plan without magnitudes (calibrated before they were recorded) is taken as in range."""
    if magnitudes is None:
        return 1.0
    if max(magnitudes.gate[e] for e in experts) > FP16_LIMIT:
        return None
    peak = max(max(magnitudes.activation[e], magnitudes.output[e]) for e in experts)
    return 1.0 if peak <= FP16_LIMIT else 2.0 ** math.ceil(math.log2(peak / FP16_LIMIT))


def decide_residency(plan: ExpertPlan, backend: BackendTraits, costs: MeasuredCosts | None = None,
                     policy: str = MEASURED) -> Residency:
    """Place every group of `plan` for `backend` from `costs`, or every one it can build under the accelerator
    `policy` (vocabulary.RESIDENCY_POLICIES).

    Without costs every group calibration saw load for is on the accelerator where the other rules allow:
    the groups a compiler builds graphs for, before a machine has measured which of them pay."""
    layers = []
    for i, layer in enumerate(plan.layers):
        placements = []
        for g, group in enumerate(layer.groups):
            capacity = aligned_capacity(plan.tiers[group.tier], backend.capacity_multiple, plan.chunk_tokens)
            placements.append(_place(plan, i, g, group, capacity, backend, costs, policy == ACCELERATOR))
        layers.append(placements)
    if costs is not None and costs.device_experts is not None:
        _within_device_memory(plan, layers, costs, costs.device_experts)
    return Residency(backend=backend.name, measured_on=costs.measured_on if costs else None,
                     fallback=costs.fallback if costs else None, layers=tuple(tuple(layer) for layer in layers))


def _within_device_memory(plan: ExpertPlan, layers: list[list[Placement]], costs: MeasuredCosts, room: int) -> None:
    """Keep on the accelerator the groups that save the most seconds per chunk while their experts fit in `room`;
    move the others to the CPU (in place)."""
    saving = {}
    for i, (layer, placements) in enumerate(zip(plan.layers, layers, strict=True)):
        for g, (group, placement) in enumerate(zip(layer.groups, placements, strict=True)):
            if placement.accelerator:
                cpu_s = costs.cost.cpu_seconds([layer.load.mean[e] for e in group.experts], costs.hidden, costs.ffn)
                saving[i, g] = cpu_s - _static_seconds(costs, i, g, len(group.experts), placement.capacity)
    for i, g in sorted(saving, key=saving.__getitem__, reverse=True):
        experts = len(plan.layers[i].groups[g].experts)
        if experts <= room:
            room -= experts
        else:
            layers[i][g] = replace(layers[i][g], accelerator=False, scale=1.0, reason=MEMORY)


def _place(plan: ExpertPlan, i: int, g: int, group: ExpertGroup, capacity: int, backend: BackendTraits,
           costs: MeasuredCosts | None, forced: bool) -> Placement:
    def cpu(reason: str) -> Placement:
        return Placement(accelerator=False, capacity=capacity, scale=1.0, reason=reason)

    layer = plan.layers[i]
    if not backend.static:
        return cpu(NO_GRAPHS)
    loads = [layer.load.mean[e] for e in group.experts]
    if not any(loads) and not forced:
        return cpu(IDLE)
    scale = fp16_scale(layer.magnitudes, group.experts) if backend.fp16 else 1.0
    if scale is None:
        return cpu(FP16_RANGE)
    if costs is not None and group_key(i, g) in costs.refused:
        return cpu(ACCURACY)
    if forced:
        return Placement(accelerator=True, capacity=capacity, scale=scale, reason=FORCED)
    if costs is None:
        return Placement(accelerator=True, capacity=capacity, scale=scale, reason=UNMEASURED)
    measure = costs.groups.get(group_key(i, g))
    if measure is not None and measure.ops and measure.device_ops < (1 - MOSTLY_OFF) * measure.ops:
        return cpu(PLACEMENT)
    if _static_seconds(costs, i, g, len(group.experts), capacity) > costs.cost.cpu_seconds(loads, costs.hidden,
                                                                                           costs.ffn):
        return cpu(CHEAPER)
    return Placement(accelerator=True, capacity=capacity, scale=scale, reason=CHEAPER)


def _static_seconds(costs: MeasuredCosts, i: int, g: int, n_experts: int, capacity: int) -> float:
    """One launch of a group's graph: as timed on the device where it was, else as the cost model expects."""
    measure = costs.groups.get(group_key(i, g))
    return measure.seconds if measure else costs.cost.group_seconds(n_experts, capacity, costs.hidden, costs.ffn)


def expected_seconds(plan: ExpertPlan, residency: Residency, costs: MeasuredCosts) -> float:
    """The MoE layers' expected seconds per chunk on the calibrated loads as `residency` places them: how
    backends compare on one machine."""
    total = 0.0
    for i, (layer, placements) in enumerate(zip(plan.layers, residency.layers, strict=True)):
        for g, (group, placement) in enumerate(zip(layer.groups, placements, strict=True)):
            if placement.accelerator:
                total += _static_seconds(costs, i, g, len(group.experts), placement.capacity)
            else:
                total += costs.cost.cpu_seconds([layer.load.mean[e] for e in group.experts], costs.hidden, costs.ffn)
    return total


def padding_cost(plan: ExpertPlan, multiple: int) -> tuple[int, int]:
    """(slots per chunk with the plan's tiers, with them aligned to `multiple`) over every group of the plan:
    what aligning for a backend costs in padding rows."""
    plain = aligned = 0
    for layer in plan.layers:
        for group in layer.groups:
            capacity = plan.tiers[group.tier]
            plain += len(group.experts) * capacity
            aligned += len(group.experts) * aligned_capacity(capacity, multiple, plan.chunk_tokens)
    return plain, aligned
