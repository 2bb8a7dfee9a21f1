"""The no-progress watchdog: when the running job last moved on, and when it counts as stalled.

The pipeline reports each step and chunk (`moved`); the worker's heartbeat thread asks `stalled_for`. A job
that has not moved for `queue.stall_seconds` is stopped at its next check (between layers or chunks) and
retried; one that does not even reach a check is stuck in a call that never returns, and the worker gives
up on the process (see Worker._beat_loop). Loading the model reports nothing while it runs, so it is not
watched: a large model on a slow disk is slow, not hung.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from npumoe.jobs.pipeline import LOADING

UNWATCHED = frozenset({LOADING})


class StallWatch:
    def __init__(self, stall_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_seconds = stall_seconds  # 0: never stalled
        self.clock = clock
        self.phase = ""
        self._moved_at: float | None = None

    def start(self) -> None:
        """A job starts: its clock starts."""
        self.phase, self._moved_at = "starting", self.clock()

    def moved(self, phase: str) -> None:
        self.phase, self._moved_at = phase, self.clock()

    def finish(self) -> None:
        self._moved_at = None

    def stalled_for(self) -> float | None:
        """Seconds since the running job last moved, once that is over `stall_seconds`; else None."""
        moved_at = self._moved_at
        if moved_at is None or not self.stall_seconds or self.phase in UNWATCHED:
            return None
        idle = self.clock() - moved_at
        return idle if idle > self.stall_seconds else None
