"""Making an `ExpertPlan` from a calibration: tiers, each expert's tier, and groups.

1. Each expert needs a capacity that covers its calibrated 95th-percentile load per chunk, rounded
   up to a multiple of `align` (static shapes like aligned sizes).
2. Tiers: the `n_tiers` capacities, shared by all layers (so few distinct graphs), that minimise
   the total capacity handed out, i.e. the padding; chosen exactly by dynamic programming over
   the distinct needs. Each expert takes the smallest tier that covers its need.
3. Groups: per layer and tier, experts by falling mean load, G at a time, so hot experts share
   graphs with hot ones and the cold ones end up together.

Which groups run on the accelerator is not decided here but for each backend and machine where the plan
runs (`residency.py`). `calibrate_plan` does it all for a model: load, calibrate, plan, save.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch

from ..loading.load import LoadedModel, load_model
from ..plan.expert_plan import ExpertGroup, ExpertLoad, ExpertPlan, LayerPlan
from ..vocabulary import CHUNK_TOKENS, FLOAT32
from .calibrate import Calibration, calibrate

DEFAULT_TIERS = 4
DEFAULT_GROUP_SIZE = 4
DEFAULT_ALIGN = 8


def calibrate_plan(model: str | Path, texts: Sequence[tuple[str, str]], out: Path, *, chunk_tokens: int = CHUNK_TOKENS,
                   n_tiers: int = DEFAULT_TIERS, group_size: int = DEFAULT_GROUP_SIZE,
                   dtype: str = FLOAT32, threads: int | None = None, trust_remote_code: bool = False,
                   allow_download: bool = False,
                   progress: AbstractContextManager[Callable[[int, int], None] | None] | None = None) -> ExpertPlan:
    """Load `model`, calibrate it on `texts` ((source name, text) pairs) and write the plan to `out`; returns
    the plan.

    `progress`, if given, is entered around the calibration pass only (not the loading); what it yields, when
    not None, is called as (chunks done, chunks in all) after each chunk. A model that cannot be loaded raises
    `ModelError`, unusable calibration settings or data `ValueError` (its parent).
    """
    if threads is not None:
        torch.set_num_threads(threads)
    loaded = load_model(model, trust_remote_code=trust_remote_code, allow_download=allow_download, dtype=dtype)
    plan = plan_loaded(loaded, texts, chunk_tokens=chunk_tokens, n_tiers=n_tiers,
                       group_size=group_size, progress=progress)
    plan.save(out)
    return plan


def plan_loaded(loaded: LoadedModel, texts: Sequence[tuple[str, str]], *, chunk_tokens: int = CHUNK_TOKENS,
                n_tiers: int = DEFAULT_TIERS, group_size: int = DEFAULT_GROUP_SIZE,
                progress: AbstractContextManager[Callable[[int, int], None] | None] | None = None) -> ExpertPlan:
    """The plan for a model already loaded, calibrated on `texts` (`progress` as for `calibrate_plan`)."""
    with progress or nullcontext() as on_chunk:
        calibration = calibrate(loaded, texts, chunk_tokens=chunk_tokens, on_chunk=on_chunk)
    return make_plan(calibration, model=loaded.name, model_key=loaded.key,
                     group_size=group_size, n_tiers=n_tiers)


def make_plan(calibration: Calibration, *, model: str, model_key: str,
              group_size: int = DEFAULT_GROUP_SIZE, n_tiers: int = DEFAULT_TIERS,
              align: int = DEFAULT_ALIGN) -> ExpertPlan:
    """The plan for `calibration`: tiers, each expert's tier, groups."""
    if group_size < 1 or n_tiers < 1 or align < 1:
        raise ValueError("group size, tier count and alignment must be positive")
    needs = {name: [_need(p95, align, calibration.chunk_tokens) for p95 in load.p95]
             for name, load in calibration.layers}
    tiers = choose_tiers([n for layer in needs.values() for n in layer if n > 0], n_tiers) or (align,)
    layers = []
    magnitudes = dict(calibration.magnitudes)
    for name, load in calibration.layers:
        expert_tier = tuple(next(t for t, c in enumerate(tiers) if c >= need) for need in needs[name])
        groups = _groups(load, expert_tier, len(tiers), group_size)
        layers.append(LayerPlan(name=name, load=load, expert_tier=expert_tier, groups=groups,
                                magnitudes=magnitudes.get(name)))
    return ExpertPlan(
        model=model, model_key=model_key, chunk_tokens=calibration.chunk_tokens,
        group_size=group_size, tiers=tiers,
        calibration_tokens=calibration.tokens, calibration_chunks=calibration.chunks,
        sources=calibration.sources, layers=tuple(layers),
    )


def choose_tiers(needs: Sequence[int], n_tiers: int) -> tuple[int, ...]:
    """At most `n_tiers` capacities minimising the sum, over needs, of the smallest capacity >= need."""
    ordered = sorted(needs)
    values = sorted(set(needs))
    covered = [bisect_right(ordered, v) for v in values]  # how many needs are <= values[j]
    # best[j]: (least total capacity for the needs <= values[j] with the top tier at values[j], the tiers)
    best = [(v * covered[j], (v,)) for j, v in enumerate(values)]
    for _ in range(n_tiers - 1):
        best = [min([best[j], *((best[p][0] + v * (covered[j] - covered[p]), (*best[p][1], v)) for p in range(j))])
                for j, v in enumerate(values)]
    return best[-1][1] if best else ()


def _need(p95: float, align: int, chunk_tokens: int) -> int:
    """Capacity covering a calibrated p95 load, aligned, never above the chunk; 0 for an idle expert."""
    if p95 <= 0:
        return 0
    return min(math.ceil(p95 / align) * align, max(chunk_tokens, 1))


def _groups(load: ExpertLoad, expert_tier: Sequence[int], n_tiers: int, group_size: int) -> tuple[ExpertGroup, ...]:
    groups = []
    for tier in range(n_tiers):
        members = sorted((e for e, t in enumerate(expert_tier) if t == tier), key=lambda e: (-load.mean[e], e))
        groups += [ExpertGroup(tier=tier, experts=tuple(members[start:start + group_size]))
                   for start in range(0, len(members), group_size)]
    return tuple(groups)
