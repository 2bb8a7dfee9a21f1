"""The job gate: whether work may run, acted on between jobs and enforced on the running job.

    between jobs (`decide`): the scheduler's decision; the reports of batch windows that closed; a power
           assertion held while an open batch window has work that may run (daemon/energy/awake.py)
    the running job (`check`, between the pipeline's steps and before every model layer):
           a stop, a stall, a lost lease or its batch window's end hands the job back (raises);
           a pause blocks until the scheduler lets it go on

With `obey_schedule` off (`npumoed run --now`, the demo) only a fault of the machine holds work back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from npumoe.jobs.errors import Stop
from npumoe.jobs.queue.store import Job, Queue

from .batch import write_batch_report
from .energy.awake import PowerAssertion, windows_to_stay_awake_for
from .heartbeat import Heartbeat, StatusRow
from .home import Home
from .scheduler import Decision, Scheduler

log = logging.getLogger(__name__)

# The check runs before every model layer: the scheduler is asked at most this often meanwhile, so that a pause or
# a closed batch window is seen within this long of a layer, without a query of the queue for every one.
RULING_SECONDS = 0.25


class JobGate:
    def __init__(self, scheduler: Scheduler, queue: Queue, home: Home, awake: PowerAssertion, *, row: StatusRow,
                 heartbeat: Heartbeat, stopping: threading.Event, poll_seconds: float, obey_schedule: bool) -> None:
        self.scheduler = scheduler
        self.queue = queue
        self.home = home  # where batch reports go
        self.awake = awake
        self.row = row
        self.heartbeat = heartbeat
        self.stopping = stopping
        self.poll_seconds = poll_seconds
        self.obey_schedule = obey_schedule
        self.job: Job | None = None  # the running job
        self._ruling: Decision | None = None  # the scheduler's last word while a job runs, and when to ask again
        self._ruling_due = 0.0

    @contextmanager
    def running(self, job: Job) -> Iterator[None]:
        """`job` runs inside: the scheduler is asked afresh for it, not taken at the last job's word."""
        self.job, self._ruling = job, None
        try:
            yield
        finally:
            self.job = None

    def decide(self) -> Decision:
        """The scheduler's decision, acted on: the reports of batch windows that closed, the power assertion."""
        decision = self._rule()
        if not self.obey_schedule:
            return decision
        for closed in self.scheduler.closed_windows():
            report = write_batch_report(self.queue, self.home, closed.window, closed.started, closed.ended)
            log.info("batch window %s closed; report in %s", closed.window, report)
        self._stay_awake(decision)
        return decision

    def check(self) -> None:
        """The running job's check: hand the job back (raise) on a stop, a stall, a lost lease or its batch
        window's end; wait (block) while the scheduler says so. It only stops or pauses: batch reports and the
        power assertion are `decide`'s, once the job is over."""
        waited = False
        while True:
            self._interrupt()
            decision = self._ruling_now(fresh=waited)
            window = self.job.batch_window if self.job else None
            if window is not None and window not in decision.open_windows:
                raise Stop(f"its batch window {window} closed")
            if decision.run:
                if waited:
                    self.row.set("working", "")
                return
            if not waited:
                log.info("pausing job %s: %s", self.row.current_job, decision.reason)
            waited = True
            self.heartbeat.stall.paused()
            self.row.set("waiting", decision.reason)
            self.stopping.wait(self.poll_seconds)

    def _interrupt(self) -> None:
        """A stop hands the job back; a stall fails this attempt; a lost lease ends it."""
        if self.stopping.is_set():
            raise Stop
        if self.job is not None and (why := self.heartbeat.ended(self.job.id)) is not None:
            raise why

    def _ruling_now(self, *, fresh: bool) -> Decision:
        """The scheduler's decision for the running job, asked again when `fresh` or after RULING_SECONDS."""
        if fresh or self._ruling is None or time.monotonic() >= self._ruling_due:
            self._ruling = self._rule()
            self._ruling_due = time.monotonic() + RULING_SECONDS
        return self._ruling

    def _rule(self) -> Decision:
        """Whether work may run now, and why not, without acting on it."""
        if not self.obey_schedule:
            fault = self.scheduler.fault_reason()  # a full disk is full whatever the schedule says
            return Decision(run=not fault, reason=fault, open_windows=tuple(self.queue.open_windows_needed()))
        return (self.job is None and self.scheduler.idle()) or self.scheduler.decide()

    def _stay_awake(self, decision: Decision) -> None:
        if windows := windows_to_stay_awake_for(decision, self.job.batch_window if self.job else None):
            self.awake.hold(f"batch window {', '.join(windows)}")
        else:
            self.awake.release()
