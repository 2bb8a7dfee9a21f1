"""How a job that did not finish ended, recorded with the queue: handed back, failed, or dead with its original set
aside; and what to do when the database will not take that record.

A database that will not record how a job ended (full, locked, its server gone) must not stop the daemon: the job
stays leased to this worker and its end is kept, to be written by `record_unsettled` before the next claim.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from .errors import Failure
from .faults import MachineFault, machine_fault
from .files import Folders, set_aside
from .queue.schema import DEAD, QUEUED
from .queue.store import Job, Queue

log = logging.getLogger(__name__)

LOST = "lost"  # the job is no longer this worker's: cancelled, or taken over while it ran
UNSETTLED = "unsettled"  # its end is not recorded yet


@dataclass(frozen=True)
class Outcome:
    job_id: int
    state: str  # done | failed | dead | queued (handed back) | LOST | UNSETTLED
    reason: str = ""
    output_dir: Path | None = None


def lost(job: Job) -> Outcome:
    return Outcome(job.id, LOST, "cancelled or taken over while it ran")


class Outcomes:
    """Records the ends of one worker's jobs that did not finish."""

    def __init__(self, queue: Queue, folders: Folders, worker_pid: int) -> None:
        self.queue = queue
        self.folders = folders
        self.pid = worker_pid
        self.unsettled: dict[int, Callable[[], Outcome]] = {}  # job id -> how it ended, not recorded yet

    def release(self, job: Job, reason: str) -> Outcome:
        """Hand the job back untouched: the worker stops, or cannot load the model."""
        return self._record(job, partial(self._released, job, reason))

    def fail(self, job: Job, failure: Failure) -> Outcome:
        return self._record(job, partial(self._failed, job, failure))

    def hand_back(self, job: Job, fault: MachineFault) -> Outcome:
        """Hand the job back for a machine fault. While that costs no attempt, the fault is raised for the worker
        to wait until it has cleared; once it keeps coming back though the machine probes well (see
        `Queue.hand_back`), it is likely the file's, and the attempt it spent is an outcome like any failure."""
        outcome = self._record(job, partial(self._handed_back, job, fault))
        if outcome.state == QUEUED:
            raise fault
        return outcome

    def machine_fault(self, error: BaseException) -> MachineFault | None:
        """`error` as a fault of the machine (the outbox's disk, the queue's database), or None."""
        return machine_fault(error, self.folders.outbox, database=self.queue.path)

    def record_unsettled(self) -> None:
        """Record the ends of jobs the database would not take when they ended (the worker calls this before it
        claims the next job); one it still will not take waits for the next call, and a machine fault is raised."""
        for job_id, settle in list(self.unsettled.items()):
            try:
                outcome = settle()
            except Exception as e:
                if (fault := self.machine_fault(e)) is not None:
                    raise fault from e
                log.warning("job %d: its end still cannot be recorded: %s: %s", job_id, type(e).__name__, e)
                continue
            del self.unsettled[job_id]
            log.info("job %d: recorded at last as %s", job_id, outcome.state)

    def _record(self, job: Job, settle: Callable[[], Outcome]) -> Outcome:
        """Record how the job ended: `settle` writes it to the queue, its values bound, as it may run again. When
        the database will not take it, the job is kept in `unsettled`, and a machine fault is raised for the worker
        to wait on."""
        try:
            return settle()
        except Exception as e:
            self.unsettled[job.id] = settle
            fault = self.machine_fault(e)
            log.warning("job %d: how it ended could not be recorded yet (%s); tried again later", job.id,
                        fault or f"{type(e).__name__}: {e}")
            if fault is not None:
                raise fault from e
            return Outcome(job.id, UNSETTLED, f"not recorded yet: {e}")

    def _released(self, job: Job, reason: str) -> Outcome:
        self.queue.release(job.id, self.pid)
        return Outcome(job.id, QUEUED, reason)

    def _handed_back(self, job: Job, fault: MachineFault) -> Outcome:
        state = self.queue.hand_back(job.id, self.pid, str(fault))
        if state is None:
            return lost(job)
        if state == QUEUED:
            return Outcome(job.id, QUEUED, f"handed back: {fault}")
        again = Failure("machine", f"{fault}, each time it was tried, while the machine itself was found working")
        return self._settled(job, state, again)

    def _failed(self, job: Job, failure: Failure) -> Outcome:
        state = self.queue.fail(job.id, self.pid, str(failure), kind=failure.kind, retryable=failure.retryable)
        if state is None:
            return lost(job)
        return self._settled(job, state, failure)

    def _settled(self, job: Job, state: str, failure: Failure) -> Outcome:
        """The outcome of a job the queue recorded as `state` (failed or dead) for `failure`; a dead one's
        original is set aside with the reason."""
        reason = str(failure)
        log.warning("job %d %s (%s): %s", job.id, state, failure.kind, reason)
        if state == DEAD and failure.set_aside:
            set_aside(
                Path(job.path),
                f"job #{job.id} gave up after {job.attempts} attempt(s)\nkind: {failure.kind}\nreason: {reason}\n",
                self.folders,
            )
        return Outcome(job.id, state, reason)
