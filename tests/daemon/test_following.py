"""A job follows its content: a queued file renamed, a first copy deleted while a copy waits, a document whose outputs
are gone dropped again, a copy dropped while the first one waits (#43, findings 2, 3 and 10)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from npumoe.daemon.config import Config
from npumoe.daemon.home import Home
from npumoe.daemon.intake import enqueue
from npumoe.daemon.worker import Worker
from npumoe.jobs.queue.store import Queue

TEXT = "The night shift files each report, checks the queue, and writes down what it could not finish.\n\n" * 4


def outputs_of(home: Home) -> list[str]:
    return sorted(p.name for p in home.outbox.iterdir() if not p.name.startswith("."))


def test_a_queued_file_renamed_before_it_runs_is_processed_under_its_new_name(
    npumoed_home: Home, queue: Queue, make_worker: Callable[..., Worker]
) -> None:
    report = npumoed_home.inbox / "report.txt"
    report.write_text(TEXT)
    worker = make_worker()
    enqueue(queue, report, worker.config)  # `npumoed add inbox/report.txt`
    report.rename(npumoed_home.inbox / "report-final.txt")
    assert dict(worker.run().outcomes) == {"done": 1}
    [job] = queue.list()
    assert job.state == "done" and Path(job.path).name == "report-final.txt"
    assert [name.rsplit("-", 1)[0] for name in outputs_of(npumoed_home)] == ["report-final"]


def test_a_copy_waiting_behind_a_first_copy_that_is_deleted_is_processed(
    npumoed_home: Home, queue: Queue, make_worker: Callable[..., Worker]
) -> None:
    first, copy = npumoed_home.inbox / "a" / "notes.txt", npumoed_home.inbox / "b" / "notes.txt"
    for path in (first, copy):
        path.parent.mkdir()
        path.write_text(TEXT)
    worker = make_worker("delete")
    enqueue(queue, first, worker.config)
    assert not worker.intake.take(copy)  # the copy waits for the first one's job: offered again, not forgotten
    first.unlink()
    assert dict(worker.run().outcomes) == {"done": 1}
    [job] = queue.list()
    assert job.path == str(copy) and len(outputs_of(npumoed_home)) == 1
    assert not copy.exists()  # deleted by policy, once its outputs were written


def test_a_document_that_died_as_missing_is_queued_again_when_its_content_reappears(
    npumoed_home: Home, queue: Queue, make_worker: Callable[..., Worker]
) -> None:
    report = npumoed_home.inbox / "report.txt"
    report.write_text(TEXT)
    enqueue(queue, report, make_worker().config)
    report.unlink()
    assert dict(make_worker().run().outcomes) == {"dead": 1}
    (npumoed_home.inbox / "report-restored.txt").write_text(TEXT)
    assert dict(make_worker().run().outcomes) == {"done": 1}
    [job] = queue.list()
    assert job.state == "done" and Path(job.path).name == "report-restored.txt"


def test_retry_of_a_job_whose_file_moved_takes_the_path_its_content_now_has(
    npumoed_home: Home, queue: Queue, make_worker: Callable[..., Worker], tmp_path: Path
) -> None:
    report = tmp_path / "report.txt"
    report.write_text(TEXT)
    enqueue(queue, report, Config())
    report.rename(tmp_path / "report-final.txt")
    queue.claim(1, lease_seconds=60)
    queue.fail(1, 1, "the file is gone", kind="missing", retryable=False)
    job = queue.retry(1, path=tmp_path / "report-final.txt")
    assert (job.state, job.path) == ("queued", str(tmp_path / "report-final.txt"))


def test_npumoed_retry_finds_a_dead_jobs_renamed_file_in_the_inbox_by_its_content(
    npumoed_home: Home, queue: Queue
) -> None:
    report = npumoed_home.inbox / "report.txt"
    report.write_text(TEXT)
    enqueue(queue, report, Config())
    report.rename(npumoed_home.inbox / "report-final.txt")
    queue.claim(1, lease_seconds=60)
    queue.fail(1, 1, "the file is gone", kind="missing", retryable=False)
    retried = subprocess.run([sys.executable, "-m", "npumoe.daemon", "retry", "1"], capture_output=True, text=True,
                             timeout=120)
    assert retried.returncode == 0 and "report-final.txt" in retried.stdout
    job = queue.get(1)
    assert job is not None and (job.state, job.path) == ("queued", str(npumoed_home.inbox / "report-final.txt"))


def test_a_document_dropped_again_after_its_outputs_were_removed_is_processed_again_not_deleted(
    npumoed_home: Home, queue: Queue, make_worker: Callable[..., Worker]
) -> None:
    (npumoed_home.inbox / "board.txt").write_text(TEXT)
    assert dict(make_worker("delete").run().outcomes) == {"done": 1}
    for output in npumoed_home.outbox.iterdir():  # the outbox cleared by a person
        shutil.rmtree(output)
    (npumoed_home.inbox / "board-again.txt").write_text(TEXT)
    assert dict(make_worker("delete").run().outcomes) == {"done": 1}
    assert [name.rsplit("-", 1)[0] for name in outputs_of(npumoed_home)] == ["board-again"]
    assert not (npumoed_home.inbox / "board-again.txt").exists()  # deleted once its outputs exist again


def test_a_copy_dropped_while_the_first_is_queued_is_settled_when_the_first_is_done(
    npumoed_home: Home, queue: Queue, make_worker: Callable[..., Worker]
) -> None:
    first, copy = npumoed_home.inbox / "report.txt", npumoed_home.inbox / "report copy.txt"
    first.write_text(TEXT)
    copy.write_text(TEXT)
    assert dict(make_worker("move").run().outcomes) == {"done": 1}
    assert sorted(p.name for p in npumoed_home.processed.iterdir()) == ["report copy.txt", "report.txt"]
    assert list(npumoed_home.inbox.iterdir()) == [] and len(queue.list()) == 1
