"""Timing a callable as the engine measures its costs: warm-up runs, then the median of repeats."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(fn: Callable[[], object], *, warmup: int = 2, repeats: int = 5) -> float:
    """Median wall seconds of `fn()` over `repeats` runs after `warmup` untimed ones.

    The median, not the mean or the minimum: on a shared machine one slow outlier should not move the
    number, and the minimum flatters what a user sees.
    """
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)

