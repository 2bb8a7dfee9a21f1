"""Timing several callables side by side, so that their ratios survive a noisy machine."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

MOST_REPEATS = 50  # rounds a short case is timed at most, however short


@dataclass(frozen=True)
class TimedElsewhere:
    """What a fn returns when its work ran in another process that timed it: the seconds that process measured
    stand for the call's (not the wall time around it, which would add the hand-over's latency)."""

    seconds: float


def interleaved_median_seconds(fns: Mapping[str, Callable[[], object]], *, warmup: int = 2,
                               repeats: int = 5) -> dict[str, float | Exception]:
    """Median wall seconds of each fn over interleaved_seconds' rounds (its exception where it raised)."""
    return {name: times if isinstance(times, Exception) else statistics.median(times)
            for name, times in interleaved_seconds(fns, warmup=warmup, repeats=repeats).items()}


def interleaved_seconds(fns: Mapping[str, Callable[[], object]], *, warmup: int = 2, repeats: int = 5,
                        min_seconds: float = 0.0,
                        most_repeats: int = MOST_REPEATS) -> dict[str, list[float] | Exception]:
    """Wall seconds of each fn in each timed round, in round order; a round runs every fn once, in an order that
    rotates from round to round: a slow spell on a shared machine then lands on all of them alike, so their ratios
    hold where their times drift (and the ratio of two fns within one round is a fair one). A fn that raises
    leaves the rounds; its exception stands in for its times. A fn that returns TimedElsewhere is timed by it.

    At least `repeats` rounds are timed, and more (up to `most_repeats`) until the timed rounds add up to
    `min_seconds`: a short case gets the rounds its spread needs, a long one is not made longer.
    """
    if warmup < 0 or repeats < 1 or min_seconds < 0 or most_repeats < repeats:
        raise ValueError(f"need warmup >= 0, repeats >= 1, min_seconds >= 0 and most_repeats >= repeats, got "
                         f"warmup={warmup}, repeats={repeats}, min_seconds={min_seconds}, most_repeats={most_repeats}")
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    failed: dict[str, Exception] = {}
    round_, timed, spent = 0, 0, 0.0
    while timed < repeats or (spent < min_seconds and timed < most_repeats):
        shift = round_ % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            if name in failed:
                continue
            start = time.perf_counter()
            try:
                result = fns[name]()
            except Exception as e:  # a benchmark reports the one that broke and times the rest
                failed[name] = e
                continue
            if round_ >= warmup:
                times[name].append(result.seconds if isinstance(result, TimedElsewhere)
                                   else time.perf_counter() - start)
                spent += times[name][-1]
        if round_ >= warmup:
            timed += 1
        round_ += 1
        if len(failed) == len(names):
            break
    return {name: failed.get(name, times[name]) for name in names}
