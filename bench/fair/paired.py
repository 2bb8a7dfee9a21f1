"""Ratios between rows timed in the same rounds, taken round by round, and what they let a report claim.

Two rows timed side by side (timing.interleaved_seconds) share every round's slow spells, so the ratio of their
times within one round is a fair one, and the spread of those ratios over the rounds is the noise the run had.
A row is "clearly faster" than another only where most of its rounds say so, not where its median happens to be
lower; and a path that did the same work as another (torch-static with nothing placed in graphs runs the CPU
path's code) is never a contender of its own.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from ..paths import CPU_PATH, ENGINE_PATHS, TORCH_STATIC_PATH

# A ratio's lowest quarter of rounds must clear 1 for it to count as faster: one lucky round cannot pick a winner.
CLEARLY = 0.25


def round_ratios(row: dict, against: dict) -> list[float]:
    """`row`'s speed as a multiple of `against`'s in each round they were timed in together (measure_impls)."""
    return [theirs / ours for ours, theirs in zip(row["round_seconds"], against["round_seconds"], strict=True)]


def ratio_range(row: dict, against: dict) -> tuple[float, float, float]:
    """(lowest, median, highest) of `row`'s round-by-round speed over `against`'s."""
    each = round_ratios(row, against)
    return min(each), statistics.median(each), max(each)


def clearly_faster(row: dict, against: dict) -> bool:
    """Whether `row` beat `against` in more than three rounds in four, by its paired ratios (never where the two
    were not timed in the same rounds: results written before rounds were kept)."""
    if not row.get("round_seconds") or len(row["round_seconds"]) != len(against.get("round_seconds", ())):
        return False
    each = sorted(round_ratios(row, against))
    return each[int(CLEARLY * (len(each) - 1))] > 1 and statistics.median(each) > 1


def same_work(row: dict) -> str | None:
    """The path whose code `row` ran when that is another path's: torch-static that launched no graph ran the CPU
    path's (engine/moe/dispatch.py sends every group it did not place to the exact CPU experts)."""
    if row["impl"] == TORCH_STATIC_PATH and row.get("launches") == 0 and row.get("static_fraction") == 0:
        return CPU_PATH
    return None


def mark_same_work(rows: list[dict]) -> list[dict]:
    """Each row that did another row's work names it (`same_work_as`), so no table reads it as a contender."""
    for row in rows:
        twin = same_work(row)
        if twin is not None:
            row["same_work_as"] = twin
    return rows


def best_engine_row(rows: Sequence[dict]) -> dict | None:
    """The engine's exact path that a speed claim is about: the one clearly faster (round by round) than every other
    exact path that passed the check and did work of its own; where none is, the first of them (the CPU path,
    the daemon's default on a CPU). Never a path that ran another's code."""
    passed = [r for r in rows if r["impl"] in ENGINE_PATHS and ENGINE_PATHS[r["impl"]].exact and r["status"] == "ok"
              and "tokens_per_s" in r and same_work(r) is None]
    for row in passed:
        if all(clearly_faster(row, other) for other in passed if other is not row):
            return row
    return passed[0] if passed else None


def add_ratios(rows: list[dict], baseline: str | None = None, priced: Mapping[str, str] | None = None) -> list[dict]:
    """Each timed row's speed relative to transformers' fastest implementation (and to `baseline`'s row, or for the
    rows named in `priced`, to the row it names: a quantized path's own roofline): the ratio of medians, and beside
    it the range of the ratio taken round by round where both were timed in the same rounds (`..._range`: lowest,
    median, highest). Then mark_same_work."""
    timed = [r for r in rows if "tokens_per_s" in r]
    transformers = [r for r in timed if r["impl"].startswith("transformers-") and "round_seconds" in r]
    best = max(transformers, key=lambda r: r["tokens_per_s"], default=None)
    named = {r["impl"]: r for r in timed}
    for row in timed:
        references = {"vs_transformers_best": best}
        if baseline:
            references[f"vs_{baseline}"] = named.get((priced or {}).get(row["impl"], baseline))
        for key, reference in references.items():
            if reference is None:
                continue
            row[key] = row["tokens_per_s"] / reference["tokens_per_s"]
            if len(row.get("round_seconds", ())) == len(reference.get("round_seconds", ())) > 0:
                row[f"{key}_range"] = list(ratio_range(row, reference))
            if reference is not best and reference["impl"] != baseline:
                row[f"{key}_row"] = reference["impl"]  # the row it was priced at
    return mark_same_work(rows)
