"""Residency: which of a plan's groups run as static graphs on a backend, decided where the plan runs.

The plan says how busy each group was in calibration; the backend's costs, measured on this machine
(`placement.py` measures and caches them), say what one launch of a group's padded graph costs here (with the
host's packing and unpacking) against running its experts on the exact CPU path; a compiled graph's own measured
time, where the backend has one, replaces the cost model's estimate for that group. The accelerator runs a layer's
groups one after another while the CPU runs the rest of its experts and the groups' spills, so a layer takes the
longer of the two, plus the host's packing before them and unpacking after (its makespan): groups are placed to make
each layer's makespan shortest, not each group alone, so a group cheaper on the accelerator stays on the CPU when
the accelerator is already the bottleneck. On a device that holds its groups' weights (a GPU) the groups moved are
those that shorten a makespan the most per expert, while they fit in the room it measured. More rules, for the
backends they concern:

- capacity alignment: each tier's capacity is padded up to the multiple the backend declares (the
  Neural Engine reads its capacity axis in 64-byte steps, 32 fp16 values), never past the chunk length;
- fp16 range: on a backend that computes in fp16, a group whose calibrated values would overflow fp16
  runs scaled (its graph computes the values divided by a power of two, which the host multiplies back)
  or, where scaling cannot help (the gate projection alone overflows), on the CPU;
- placement: a group whose compiled graph Core ML would run mostly off the Neural Engine stays on the CPU;
- accuracy: a group whose graph the accuracy gate refused (`backends/graph_check.py`: wrong or not finite on a
  probe against the exact CPU path) stays on the CPU, whatever the policy.

Under the `accelerator` policy every group the backend can build (in fp16's range, within its device's memory)
runs on it, idle or costly ones included: the planned path run end to end on any machine, to see it and test it.
"""

from __future__ import annotations

import heapq
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
CHEAPER = "cheaper"  # its layer's makespan (accelerator beside CPU), measured or modelled, is shorter this way
IDLE = "idle"  # calibration routed no token to its experts
FP16_RANGE = "fp16 range"  # its values overflow fp16 even scaled
PLACEMENT = "placement"  # Core ML places most of its ops off the Neural Engine
MEMORY = "device memory"  # it would shorten its layer, but its experts do not fit beside the groups that save more
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

    seconds: float | None  # None: not timed (mostly off the Neural Engine: it stays on the CPU whatever its time)
    device_ops: int = 0  # its ops Core ML places on the Neural Engine
    ops: int = 0  # all its ops (0: not read)

    @property
    def mostly_off(self) -> bool:
        """Whether Core ML places most of its ops off the Neural Engine (then it stays on the CPU)."""
        return bool(self.ops) and self.device_ops < (1 - MOSTLY_OFF) * self.ops


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
    if costs is not None and policy != ACCELERATOR:
        _by_makespan(plan, layers, costs, costs.device_experts)
    elif costs is not None and costs.device_experts is not None:
        _within_device_memory(plan, layers, costs, costs.device_experts)
    return Residency(backend=backend.name, measured_on=costs.measured_on if costs else None,
                     fallback=costs.fallback if costs else None, layers=tuple(tuple(layer) for layer in layers))


def _within_device_memory(plan: ExpertPlan, layers: list[list[Placement]], costs: MeasuredCosts, room: int) -> None:
    """Under the accelerator policy: keep on the accelerator the groups that save the most seconds per chunk while
    their experts fit in `room`; move the others to the CPU (in place)."""
    saving = {}
    for i, (layer, placements) in enumerate(zip(plan.layers, layers, strict=True)):
        for g, (group, placement) in enumerate(zip(layer.groups, placements, strict=True)):
            if placement.accelerator:
                loads = [layer.load.mean[e] for e in group.experts]
                saving[i, g] = costs.cost.cpu_seconds(loads, costs.hidden, costs.ffn) - (
                    _graph_seconds(costs, i, g, len(loads), placement.capacity)
                    + _host_seconds(costs, loads, placement.capacity))
    for i, g in sorted(saving, key=saving.__getitem__, reverse=True):
        experts = len(plan.layers[i].groups[g].experts)
        if experts <= room:
            room -= experts
        else:
            layers[i][g] = replace(layers[i][g], accelerator=False, scale=1.0, reason=MEMORY)


@dataclass(frozen=True)
class LayerSeconds:
    """A layer's expected seconds per chunk, by who spends them: the host packing the group buffers before the
    launches and unpacking after them, the accelerator's launches one after another, and the CPU's experts and
    spills beside them. The layer takes host + the longer of the other two (its makespan)."""

    host: float = 0.0
    accelerator: float = 0.0
    cpu: float = 0.0

    @property
    def makespan(self) -> float:
        return self.host + max(self.accelerator, self.cpu)

    def __add__(self, other: LayerSeconds) -> LayerSeconds:
        return LayerSeconds(self.host + other.host, self.accelerator + other.accelerator, self.cpu + other.cpu)

    def __sub__(self, other: LayerSeconds) -> LayerSeconds:
        return LayerSeconds(self.host - other.host, self.accelerator - other.accelerator, self.cpu - other.cpu)


@dataclass(frozen=True)
class _Move:
    """Moving one candidate group of a layer from the CPU to the accelerator."""

    gain: float  # seconds the layer's makespan shortens by
    group: int


def _by_makespan(plan: ExpertPlan, layers: list[list[Placement]], costs: MeasuredCosts, room: int | None) -> None:
    """Decide the candidate groups `_place` left on the accelerator (in place): each layer starts with all of them on
    the CPU, then moves, one at a time, the group that shortens its makespan most, while any does. Under a device
    memory `room` (experts) the layers' moves are taken across the plan by gain per expert, each layer's in its own
    order, until a layer's next does not fit: that group and the rest of its layer's moves stay on the CPU."""
    candidates: list[dict[int, Placement]] = []
    moves = []
    for i, placements in enumerate(layers):
        candidates.append({g: p for g, p in enumerate(placements) if p.accelerator})
        for g, placement in candidates[i].items():
            placements[g] = replace(placement, accelerator=False, scale=1.0)
        shifts = {g: _group_seconds(plan, costs, i, g, p) - _group_seconds(plan, costs, i, g, placements[g])
                  for g, p in candidates[i].items()}
        moves.append(_layer_moves(layer_seconds(plan, costs, i, placements), shifts))
    taken = _within_room(plan, moves, room)
    for i, (layer_moves, placements) in enumerate(zip(moves, layers, strict=True)):
        for move in layer_moves:
            placements[move.group] = (candidates[i][move.group] if (i, move.group) in taken
                                      else replace(placements[move.group], reason=MEMORY))


def layer_seconds(plan: ExpertPlan, costs: MeasuredCosts, i: int, placements: Sequence[Placement]) -> LayerSeconds:
    """Plan layer i's expected seconds per chunk as `placements` place its groups."""
    total = LayerSeconds()
    for g, placement in enumerate(placements):
        total += _group_seconds(plan, costs, i, g, placement)
    return total


def _group_seconds(plan: ExpertPlan, costs: MeasuredCosts, i: int, g: int, placement: Placement) -> LayerSeconds:
    """What one group adds to its layer's seconds: on the accelerator its launch, the host's packing of its filled
    rows and its spill on the CPU; on the CPU its experts' cost."""
    loads = [plan.layers[i].load.mean[e] for e in plan.layers[i].groups[g].experts]
    if not placement.accelerator:
        return LayerSeconds(cpu=costs.cost.cpu_seconds(loads, costs.hidden, costs.ffn))
    return LayerSeconds(host=_host_seconds(costs, loads, placement.capacity),
                        accelerator=_graph_seconds(costs, i, g, len(loads), placement.capacity),
                        cpu=costs.cost.spill_seconds(loads, placement.capacity, costs.hidden, costs.ffn))


def _within_room(plan: ExpertPlan, moves: list[list[_Move]], room: int | None) -> set[tuple[int, int]]:
    """(layer, group) of the moves taken: all of them without a room; else by gain per expert while they fit."""
    if room is None:
        return {(i, move.group) for i, layer_moves in enumerate(moves) for move in layer_moves}

    def size(i: int, k: int) -> int:
        return len(plan.layers[i].groups[moves[i][k].group].experts)

    heap = [(-layer_moves[0].gain / size(i, 0), i, 0) for i, layer_moves in enumerate(moves) if layer_moves]
    heapq.heapify(heap)
    taken = set()
    while heap:
        _, i, k = heapq.heappop(heap)
        if size(i, k) > room:
            continue  # this layer's next move does not fit: it and the layer's later ones stay on the CPU
        room -= size(i, k)
        taken.add((i, moves[i][k].group))
        if k + 1 < len(moves[i]):
            heapq.heappush(heap, (-moves[i][k + 1].gain / size(i, k + 1), i, k + 1))
    return taken


def _layer_moves(now: LayerSeconds, shifts: dict[int, LayerSeconds]) -> list[_Move]:
    """One layer's greedy moves from `now`, in the order taken: each the candidate whose move leaves the shortest
    makespan. `shifts`: what moving each group changes in the layer's seconds."""
    left, moves = dict(shifts), []
    while left:
        g = min(left, key=lambda g: ((now + left[g]).makespan, left[g].cpu))
        after = now + left.pop(g)
        if after.makespan >= now.makespan:
            break
        moves.append(_Move(now.makespan - after.makespan, g))
        now = after
    return moves


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
    if measure is not None and measure.mostly_off:
        return cpu(PLACEMENT)
    return Placement(accelerator=True, capacity=capacity, scale=scale, reason=CHEAPER)  # a candidate: see _by_makespan


def _graph_seconds(costs: MeasuredCosts, i: int, g: int, n_experts: int, capacity: int) -> float:
    """One launch of a group's graph: as timed on the device where it was, else as the cost model expects."""
    measure = costs.groups.get(group_key(i, g))
    if measure is not None and measure.seconds is not None:
        return measure.seconds
    return costs.cost.graph_seconds(n_experts, capacity, costs.hidden, costs.ffn)


def _host_seconds(costs: MeasuredCosts, mean_loads: Sequence[float], capacity: int) -> float:
    """The host's packing and unpacking of the rows a group's experts fill at their mean loads."""
    return costs.cost.host_seconds(sum(min(load, capacity) for load in mean_loads))


def expected_seconds(plan: ExpertPlan, residency: Residency, costs: MeasuredCosts) -> float:
    """The MoE layers' expected seconds per chunk on the calibrated loads as `residency` places them (each layer its
    makespan): how backends compare on one machine."""
    return sum(layer_seconds(plan, costs, i, placements).makespan for i, placements in enumerate(residency.layers))


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
