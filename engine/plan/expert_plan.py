"""`ExpertPlan`: what calibration measured for one model, as versioned JSON; any backend runs it.

It records what a graph compiler and the dispatcher need: a few tiers (static capacities, tokens
per expert per chunk), and per MoE layer each expert's calibrated load, largest magnitudes and
tier, and the groups of up to G experts of one tier that run as one (G, C, H) graph. Also the chunk
length and what it was calibrated on. Where each group runs (residency) is not in the plan: it is
decided for the backend and machine at hand (`residency.py`); nor is the overflow policy, which the
run's settings choose (exact or fast) over the same tiers. Version 1 files, which held one backend's
residency and costs, and version 2 files, which held an overflow policy that decided nothing, still
load: those parts are dropped. Loading validates every field.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

PLAN_FORMAT = "npumoe.expert-plan"
# version 3: no overflow policy (an older engine refuses the plan by its version, not by a missing field)
PLAN_VERSION = 3
READABLE_VERSIONS = (1, 2, PLAN_VERSION)
LOAD_STATISTICS = ("mean", "p50", "p95", "max")
MAGNITUDES = ("activation", "gate", "output")


class PlanError(ValueError):
    """A plan file that is unreadable or inconsistent; the message names the field."""


@dataclass(frozen=True)
class ExpertLoad:
    """Per expert: routed tokens per calibration chunk."""

    mean: tuple[float, ...]
    p50: tuple[float, ...]
    p95: tuple[float, ...]
    max: tuple[float, ...]


@dataclass(frozen=True)
class ExpertMagnitudes:
    """Per expert: the largest absolute values calibration saw inside it (what fp16 must hold).

    `activation`: its input rows, its up projection and the gated product act(gate)·up; a graph scaled
    by s divides all of them by s. `gate`: the gate projection before the activation, which scaling
    leaves as it is. `output`: the expert's output rows, divided by s too."""

    activation: tuple[float, ...]
    gate: tuple[float, ...]
    output: tuple[float, ...]


@dataclass(frozen=True)
class ExpertGroup:
    tier: int
    experts: tuple[int, ...]


@dataclass(frozen=True)
class LayerPlan:
    name: str  # the experts module's qualified name in the model
    load: ExpertLoad
    expert_tier: tuple[int, ...]
    groups: tuple[ExpertGroup, ...]
    magnitudes: ExpertMagnitudes | None = None  # None in plans calibrated before they were recorded

    @property
    def num_experts(self) -> int:
        return len(self.expert_tier)


@dataclass(frozen=True)
class ExpertPlan:
    model: str
    model_key: str
    chunk_tokens: int
    group_size: int
    tiers: tuple[int, ...]  # capacity of each tier, ascending
    calibration_tokens: int
    calibration_chunks: int
    sources: tuple[str, ...]
    layers: tuple[LayerPlan, ...]
    version: int = field(default=PLAN_VERSION)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        return {"format": PLAN_FORMAT, "version": data.pop("version"), **data}

    def digest(self) -> str:
        """A short digest of the whole plan: what measured costs and residency are cached under."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def save(self, path: Path) -> None:
        """Write the JSON atomically (temporary file, then rename)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> ExpertPlan:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise PlanError(f"{path}: cannot read plan: {e}") from e
        try:
            return cls.from_dict(data)
        except PlanError as e:
            raise PlanError(f"{path}: {e}") from e

    @classmethod
    def from_dict(cls, data: Any) -> ExpertPlan:
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            raise PlanError(f"not an expert plan (format must be {PLAN_FORMAT!r})")
        if data.get("version") not in READABLE_VERSIONS:
            raise PlanError(f"plan version {data.get('version')!r} is not supported (this engine reads "
                            f"versions {', '.join(map(str, READABLE_VERSIONS))})")
        tiers = tuple(_ints(data, "tiers"))
        if not tiers or tiers[0] < 1 or any(a >= b for a, b in pairwise(tiers)):
            raise PlanError(f"tiers: must be strictly increasing positive capacities, got {list(tiers)}")
        group_size = _positive(data, "group_size")
        layers = tuple(_layer(layer, f"layers[{i}]", len(tiers), group_size)
                       for i, layer in enumerate(_get(data, "layers", list)))
        if not layers:
            raise PlanError("layers: the plan has no MoE layers")
        if len({layer.name for layer in layers}) != len(layers):
            raise PlanError("layers: two layers have the same name")
        return cls(
            model=_get(data, "model", str), model_key=_get(data, "model_key", str),
            chunk_tokens=_positive(data, "chunk_tokens"), group_size=group_size, tiers=tiers,
            calibration_tokens=_get(data, "calibration_tokens", int),
            calibration_chunks=_get(data, "calibration_chunks", int),
            sources=tuple(_strings(data, "sources")), layers=layers,
        )


def _layer(data: Any, where: str, n_tiers: int, group_size: int) -> LayerPlan:
    if not isinstance(data, dict):
        raise PlanError(f"{where}: must be an object")
    name = _get(data, "name", str, where)
    expert_tier = tuple(_ints(data, "expert_tier", where))
    n_experts = len(expert_tier)
    if n_experts == 0 or any(not 0 <= t < n_tiers for t in expert_tier):
        raise PlanError(f"{where}.expert_tier: must list each expert's tier in 0..{n_tiers - 1}")
    load = ExpertLoad(**_per_expert(_get(data, "load", dict, where), LOAD_STATISTICS, f"{where}.load", n_experts))
    magnitudes = None
    if data.get("magnitudes") is not None:
        magnitudes = ExpertMagnitudes(**_per_expert(_get(data, "magnitudes", dict, where), MAGNITUDES,
                                                    f"{where}.magnitudes", n_experts))
    groups = []
    seen: set[int] = set()
    for g, group in enumerate(_get(data, "groups", list, where)):
        at = f"{where}.groups[{g}]"
        if not isinstance(group, dict):
            raise PlanError(f"{at}: must be an object")
        tier = _get(group, "tier", int, at)
        experts = tuple(_ints(group, "experts", at))
        if not 1 <= len(experts) <= group_size:
            raise PlanError(f"{at}.experts: must hold 1..{group_size} experts, got {len(experts)}")
        for e in experts:
            if not 0 <= e < n_experts:
                raise PlanError(f"{at}.experts: expert {e} is out of range 0..{n_experts - 1}")
            if e in seen:
                raise PlanError(f"{at}.experts: expert {e} is already in another group")
            if expert_tier[e] != tier:
                raise PlanError(f"{at}: expert {e} has tier {expert_tier[e]}, but the group's tier is {tier}")
            seen.add(e)
        groups.append(ExpertGroup(tier=tier, experts=experts))
    if len(seen) != n_experts:
        missing = sorted(set(range(n_experts)) - seen)
        raise PlanError(f"{where}.groups: experts {missing} are in no group")
    return LayerPlan(name=name, load=load, expert_tier=expert_tier, groups=tuple(groups), magnitudes=magnitudes)


def _per_expert(data: dict, names: Sequence[str], where: str, n_experts: int) -> dict[str, tuple[float, ...]]:
    """Each of `names` in `data` as one non-negative number per expert."""
    found = {}
    for name in names:
        values = _get(data, name, list, where)
        if len(values) != n_experts or not all(isinstance(v, int | float) and v >= 0 for v in values):
            raise PlanError(f"{where}.{name}: must hold {n_experts} non-negative numbers")
        found[name] = tuple(float(v) for v in values)
    return found


def _get(data: dict, key: str, kind: type, where: str = "") -> Any:
    label = f"{where}.{key}" if where else key
    if key not in data:
        raise PlanError(f"{label}: missing")
    value = data[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise PlanError(f"{label}: must be {kind.__name__}, got {type(value).__name__}")
    return value


def _ints(data: dict, key: str, where: str = "") -> Sequence[int]:
    values = _get(data, key, list, where)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise PlanError(f"{where + '.' if where else ''}{key}: must be a list of integers")
    return values


def _strings(data: dict, key: str) -> Sequence[str]:
    values = _get(data, key, list)
    if not all(isinstance(v, str) for v in values):
        raise PlanError(f"{key}: must be a list of strings")
    return values


def _positive(data: dict, key: str) -> int:
    value = _get(data, key, int)
    if value < 1:
        raise PlanError(f"{key}: must be positive, got {value}")
    return value
