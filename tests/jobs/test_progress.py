"""A running job's progress, recorded with the job: each step, then each chunk with its rate and time left."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from npumoe.engine import Progress
from npumoe.jobs.errors import Lost
from npumoe.jobs.progress import JobProgress
from npumoe.jobs.queue.store import Job, Queue


@pytest.fixture
def job(queue: Queue, tmp_path: Path, claim: Callable[..., Job]) -> Job:
    path = tmp_path / "a.txt"
    path.write_text("A.\n")
    return claim(queue, path)


def recorded(queue: Queue, job: Job) -> tuple[float, dict[str, object]]:
    after = queue.get(job.id)
    assert after is not None and after.detail is not None
    return after.progress, json.loads(after.detail)


def test_a_step_is_recorded_with_the_job_and_told_to_the_worker(queue: Queue, job: Job, worker_pid: int) -> None:
    told: list[str] = []
    JobProgress(queue, job, worker_pid, 60.0, told.append).report("extracting")
    assert told == ["extracting"] and recorded(queue, job)[1] == {"phase": "extracting"}


def test_a_chunk_records_how_far_through_the_document_and_how_fast(queue: Queue, job: Job, worker_pid: int) -> None:
    JobProgress(queue, job, worker_pid, 60.0, lambda phase: None).engine_moved(Progress("prefill", 1, 4, 25, 100, 0.5))
    progress, detail = recorded(queue, job)
    assert progress == 0.25
    assert detail == {"phase": "prefill", "step": 1, "steps": 4, "tokens_done": 25, "tokens_total": 100,
                      "tokens_per_s": 50.0, "eta_s": 1.5}


def test_the_last_chunk_is_not_done_until_the_summary_is(queue: Queue, job: Job, worker_pid: int) -> None:
    JobProgress(queue, job, worker_pid, 60.0, lambda phase: None).engine_moved(Progress("summary", 4, 4, 100, 100, 2))
    assert recorded(queue, job)[0] == 0.99


def test_a_job_cancelled_meanwhile_is_lost_at_its_next_record(queue: Queue, job: Job, worker_pid: int) -> None:
    queue.cancel(job.id)
    with pytest.raises(Lost):
        JobProgress(queue, job, worker_pid, 60.0, lambda phase: None).report("extracting")
