"""What `npumoed status` reads of the running daemon, the heartbeat that keeps it and the running job's lease
fresh, and the no-progress watchdog that heartbeat carries.

    StatusRow   the daemon's row: activity, reason, current job, power, counters; written when what it says
                changes, and on every beat while a job runs
    StallWatch  when the running job last moved on (the pipeline reports each step and chunk)
    Heartbeat   a thread: every BEAT_SECONDS it renews the running job's lease and the row, and asks the
                watch; a job lost to another worker or stalled is marked for the job gate to end at its next
                check; one stuck in a call that never returns makes the process exit (EXIT_STUCK)

Loading the model reports nothing while it runs, so it is not watched: a large model on a slow disk is slow,
not hung.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from npumoe.jobs.errors import Failure, Lost
from npumoe.jobs.pipeline import LOADING
from npumoe.jobs.queue.store import Queue

log = logging.getLogger(__name__)

BEAT_SECONDS = 2.0  # how often the heartbeat row (and the running job's lease) is renewed
EXIT_STUCK = 75  # EX_TEMPFAIL: the process gave up on a call that never returned; the service restarts it
UNWATCHED = frozenset({LOADING})


class StatusRow:
    """The daemon's row in the queue's database. Idle, it is written only when what it says changes."""

    def __init__(self, queue: Queue, *, power: Callable[[], dict[str, Any]],
                 counters: Callable[[], dict[str, int]]) -> None:
        self.queue = queue
        self.power = power
        self.counters = counters
        self._state: dict[str, Any] = {"activity": "starting", "reason": "", "current_job": None}
        self._written: dict[str, Any] = {}  # the row as last written, to write only what changed

    @property
    def current_job(self) -> int | None:
        return self._state["current_job"]

    def open(self, **daemon: Any) -> None:
        """The daemon started: who it is (pid, model, backend), and the row as it stands."""
        self.queue.daemons.write(started_at=time.time(), stopped_at=None, **daemon)
        self.write()

    def set(self, activity: str, reason: str, **values: Any) -> None:
        self._state.update(activity=activity, reason=reason, **values)
        self.write()

    def write(self, *, beat: bool = False) -> None:
        """Write the row when what it says changed; `beat`: also to renew its heartbeat (a job runs)."""
        row = {**self._state, "power": self.power(), "counters": self.counters()}
        if beat or row != self._written:
            self.queue.daemons.write(heartbeat_at=time.time(), **row)
            self._written = row

    def close(self) -> None:
        self.set("stopped", "", current_job=None)
        self.queue.daemons.write(stopped_at=time.time())


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

    def paused(self) -> None:
        """The job waits for the scheduler: a pause is not a stall, so the clock starts again."""
        self.moved(self.phase)

    def finish(self) -> None:
        self._moved_at = None

    def stalled_for(self) -> float | None:
        """Seconds since the running job last moved, once that is over `stall_seconds`; else None."""
        moved_at = self._moved_at
        if moved_at is None or not self.stall_seconds or self.phase in UNWATCHED:
            return None
        idle = self.clock() - moved_at
        return idle if idle > self.stall_seconds else None


class Heartbeat:
    """The heartbeat thread. The running job is the row's `current_job`; `ended` tells the job gate whether the
    heartbeat gave up on it."""

    def __init__(self, queue: Queue, row: StatusRow, stall: StallWatch, *, pid: int, lease_seconds: float,
                 stopping: threading.Event) -> None:
        self.queue = queue
        self.row = row
        self.stall = stall
        self.pid = pid
        self.lease_seconds = lease_seconds
        self.stopping = stopping
        self._lost_job: int | None = None  # its lease could not be renewed: another worker took it over
        self._stalled_job: int | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self._thread.start()

    def join(self) -> None:
        """After `stopping` is set: the last beat is over."""
        if self._thread is not None:
            self._thread.join(timeout=BEAT_SECONDS * 2)

    @contextmanager
    def watching(self) -> Iterator[None]:
        """A job runs inside: nothing is held against it yet, and its stall clock runs."""
        self._lost_job = self._stalled_job = None
        self.stall.start()
        try:
            yield
        finally:
            self.stall.finish()

    def ended(self, job_id: int) -> Exception | None:
        """Why the running job `job_id` must end now, if the heartbeat gave up on it: stalled (this attempt
        fails, to be tried again), or lost to another worker."""
        if self._stalled_job == job_id:
            return Failure("stalled", f"no progress for over {self.stall.stall_seconds:g} s while "
                           f"{self.stall.phase} (queue.stall_seconds); stopped, to be tried again", retryable=True)
        if self._lost_job == job_id:
            return Lost()
        return None

    def _beat(self) -> None:
        while not self.stopping.wait(BEAT_SECONDS):
            try:
                job_id = self.row.current_job
                if job_id is not None and (stalled := self.stall.stalled_for()) is not None:
                    self._on_stall(job_id, stalled)  # and the lease is no longer renewed
                elif job_id is not None and not self.queue.heartbeat(job_id, self.pid,
                                                                     lease_seconds=self.lease_seconds):
                    self._lost_job = job_id
                self.row.write(beat=job_id is not None)
            except Exception:  # a busy database must not end the heartbeat for good
                log.exception("heartbeat failed")

    def _on_stall(self, job_id: int, stalled: float) -> None:
        """First ask the job to stop at its next check; if it has not reached one after as long again (at least
        a few beats, at most a minute), it is stuck in a call that never returns: record that and exit."""
        if self._stalled_job != job_id:
            log.warning("job %d: no progress for %.0f s while %s; stopping it", job_id, stalled, self.stall.phase)
            self._stalled_job = job_id
            return
        grace = min(max(self.stall.stall_seconds, 3 * BEAT_SECONDS), 60.0)
        if stalled < self.stall.stall_seconds + grace:
            return
        reason = (f"no progress for {stalled:.0f} s while {self.stall.phase}, and stuck in a call that did not "
                  "return; npumoed exited to be restarted")
        self.queue.fail(job_id, self.pid, reason, kind="stalled", retryable=True)
        log.critical("job %d: %s", job_id, reason)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(EXIT_STUCK)
