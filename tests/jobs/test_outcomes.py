"""How a job that did not finish ended, recorded with the queue: handed back, failed, dead and set aside, lost, or
kept until the database takes it."""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path

import pytest

from npumoe.jobs.errors import Failure
from npumoe.jobs.faults import MachineFault
from npumoe.jobs.files import Folders
from npumoe.jobs.outcomes import LOST, UNSETTLED, Outcomes
from npumoe.jobs.queue.store import Job, Queue


@pytest.fixture
def outcomes(queue: Queue, inbox_folders: Folders, worker_pid: int) -> Outcomes:
    return Outcomes(queue, inbox_folders, worker_pid)


@pytest.fixture
def document(inbox_folders: Folders) -> Path:
    path = inbox_folders.inboxes[0] / "report.txt"
    path.write_text("A report.\n")
    return path


def test_a_failure_on_the_last_attempt_is_dead_and_sets_the_original_aside_with_its_reason(
    outcomes: Outcomes, queue: Queue, document: Path, claim: Callable[..., Job]
) -> None:
    job = claim(queue, document, max_attempts=1)
    outcome = outcomes.fail(job, Failure("corrupt", "not a document at all"))
    assert (outcome.state, outcome.reason) == ("dead", "not a document at all")
    failed = outcomes.folders.failed
    assert (failed / "report.txt").exists() and not document.exists()
    assert "kind: corrupt\nreason: not a document at all" in (failed / "report.txt.error.txt").read_text()


def test_a_failure_that_is_not_the_files_leaves_it_where_it_is(
    outcomes: Outcomes, queue: Queue, document: Path, claim: Callable[..., Job]
) -> None:
    job = claim(queue, document, max_attempts=1)
    assert outcomes.fail(job, Failure("changed", "its new content is job #2", set_aside=False)).state == "dead"
    assert document.exists() and list(outcomes.folders.failed.iterdir()) == []


def test_a_retryable_failure_with_attempts_left_waits_in_the_queue(
    outcomes: Outcomes, queue: Queue, document: Path, claim: Callable[..., Job]
) -> None:
    job = claim(queue, document)
    assert outcomes.fail(job, Failure("engine", "the engine failed", retryable=True)).state == "failed"
    assert document.exists()


def test_a_released_job_is_queued_again_without_spending_an_attempt(
    outcomes: Outcomes, queue: Queue, document: Path, claim: Callable[..., Job]
) -> None:
    job = claim(queue, document)
    assert outcomes.release(job, "handed back: stopping").state == "queued"
    after = queue.get(job.id)
    assert after is not None and (after.state, after.attempts) == ("queued", 0)


def test_a_job_handed_back_for_the_machine_raises_the_fault_for_the_worker_to_wait_on(
    outcomes: Outcomes, queue: Queue, document: Path, claim: Callable[..., Job]
) -> None:
    job = claim(queue, document)
    fault = MachineFault(outcomes.folders.outbox, code=errno.EIO)
    with pytest.raises(MachineFault) as raised:
        outcomes.hand_back(job, fault)
    assert raised.value is fault
    after = queue.get(job.id)
    assert after is not None and (after.state, after.attempts, after.last_error) == ("queued", 0, str(fault))


def test_a_job_cancelled_meanwhile_is_lost_and_nothing_is_set_aside(
    outcomes: Outcomes, queue: Queue, document: Path, claim: Callable[..., Job]
) -> None:
    job = claim(queue, document, max_attempts=1)
    queue.cancel(job.id)
    assert outcomes.fail(job, Failure("corrupt", "not a document")).state == LOST
    assert document.exists()


def test_an_end_the_database_will_not_take_is_kept_and_recorded_by_the_next_call(
    outcomes: Outcomes, queue: Queue, document: Path, claim: Callable[..., Job], monkeypatch: pytest.MonkeyPatch
) -> None:
    job = claim(queue, document)
    real_fail, tries = queue.fail, []

    def fail_once(*args: object, **kwargs: object) -> str | None:
        tries.append(args)
        if len(tries) == 1:
            raise RuntimeError("the server went away")
        return real_fail(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(queue, "fail", fail_once)
    assert outcomes.fail(job, Failure("engine", "the engine failed", retryable=True)).state == UNSETTLED
    assert list(outcomes.unsettled) == [job.id]
    outcomes.record_unsettled()
    after = queue.get(job.id)
    assert after is not None and after.state == "failed" and outcomes.unsettled == {} and len(tries) == 2
