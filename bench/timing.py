"""Timing several callables side by side, so that their ratios survive a noisy machine."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping


def interleaved_median_seconds(fns: Mapping[str, Callable[[], object]], *, warmup: int = 2,
                               repeats: int = 5) -> dict[str, float | Exception]:
    """Median wall seconds of each fn, timed in rounds that run every fn once, in an order that rotates
    from round to round: a slow spell on a shared machine then lands on all of them alike, so their ratios
    hold where their times drift. A fn that raises leaves the rounds; its exception stands in for its time.
    """
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    failed: dict[str, Exception] = {}
    for round_ in range(warmup + repeats):
        shift = round_ % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            if name in failed:
                continue
            start = time.perf_counter()
            try:
                fns[name]()
            except Exception as e:  # a benchmark reports the one that broke and times the rest
                failed[name] = e
                continue
            if round_ >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: failed[name] if name in failed else statistics.median(times[name]) for name in names}
