"""A running job's progress, recorded with the job in the queue: each step of the pipeline, then each chunk and
summary step of the engine. Every record renews the job's lease; one the queue refuses means the job is no longer
this worker's (Lost)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from npumoe.engine.vocabulary import PREFILL

from .errors import Lost
from .queue.store import Job, Queue

if TYPE_CHECKING:
    from npumoe.engine import Progress


class JobProgress:
    def __init__(self, queue: Queue, job: Job, worker_pid: int, lease_seconds: float,
                 progressed: Callable[[str], None]) -> None:
        """`progressed(phase)` tells the worker, too, each time the job moves on."""
        self.queue = queue
        self.job = job
        self.pid = worker_pid
        self.lease_seconds = lease_seconds
        self.progressed = progressed

    def report(self, phase: str, *, progress: float | None = None, **detail: Any) -> None:
        self.progressed(phase)
        if not self.queue.heartbeat(
            self.job.id,
            self.pid,
            lease_seconds=self.lease_seconds,
            progress=progress,
            detail={"phase": phase, **detail},
        ):
            raise Lost

    def model_loaded(self) -> None:
        """Tell the worker the engine starts: from now on, a job that does not move has stalled."""
        self.progressed(PREFILL)

    def engine_moved(self, p: Progress) -> None:
        """After every chunk and every summary step.

        Prefill tokens measure the way through a document: the summary steps between them are counted
        by `step`/`steps`, and the reduce steps that follow the last chunk are short.
        """
        rate = p.tokens_done / p.elapsed_s if p.elapsed_s > 0 else None
        eta = (p.tokens_total - p.tokens_done) / rate if rate else None
        done = min(p.tokens_done / p.tokens_total, 0.99) if p.tokens_total else 0.0
        self.report(
            p.phase,
            progress=done,
            step=p.chunks_done,
            steps=p.chunks_total,
            tokens_done=p.tokens_done,
            tokens_total=p.tokens_total,
            tokens_per_s=rate,
            eta_s=eta,
        )
