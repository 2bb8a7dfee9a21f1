"""The engine's run over a document: the worker's own exceptions pass through, the engine's become the job's
Failure, retried unless the engine refused the input."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from stand_in_engine import StandInEngine

from npumoe.jobs.errors import Failure, Stop
from npumoe.jobs.inference import run_engine
from npumoe.jobs.progress import JobProgress
from npumoe.jobs.queue.store import Job, Queue


@pytest.fixture
def progress(queue: Queue, tmp_path: Path, claim: Callable[..., Job], worker_pid: int) -> JobProgress:
    path = tmp_path / "a.txt"
    path.write_text("A.\n")
    return JobProgress(queue, claim(queue, path), worker_pid, 60.0, lambda phase: None)


def test_the_engine_runs_the_check_and_reports_each_chunk(progress: JobProgress, queue: Queue) -> None:
    checks: list[int] = []
    told: list[str] = []
    progress.progressed = told.append
    result = run_engine(StandInEngine(chunks=2), "Some text.", progress, lambda: checks.append(1))
    assert result.summary == "The stand-in summary." and len(checks) == 2
    assert told == ["prefill", "prefill", "prefill"]  # the model loaded, then each chunk
    after = queue.get(progress.job.id)
    assert after is not None and after.progress == 0.99


@pytest.mark.parametrize(("error", "kind", "retryable"), [
    (MemoryError(), "memory", True),
    (ValueError("the text is empty"), "engine", False),
    (RuntimeError("a kernel failed"), "engine", True),
])
def test_the_engines_errors_are_the_jobs_failures(
    progress: JobProgress, error: Exception, kind: str, retryable: bool
) -> None:
    with pytest.raises(Failure) as failure:
        run_engine(StandInEngine(error=error), "Some text.", progress, lambda: None)
    assert (failure.value.kind, failure.value.retryable) == (kind, retryable)


def test_a_stop_raised_by_the_check_within_the_engine_is_the_workers_not_a_failure(progress: JobProgress) -> None:
    def stop() -> None:
        raise Stop

    with pytest.raises(Stop):
        run_engine(StandInEngine(), "Some text.", progress, stop)
