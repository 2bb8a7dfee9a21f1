"""The worker loop in this process, on the tiny model: intake, one daemon per npumoed_home, recovery, pause, stop."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pytest
from filelock import FileLock

from npumoe.daemon.home import Home
from npumoe.daemon.intake import sha256_of
from npumoe.daemon.worker import AlreadyRunning, Worker
from npumoe.jobs import files
from npumoe.jobs.errors import ModelUnavailable
from npumoe.jobs.queue.store import BATCH, Queue

PARAGRAPH = "The night shift files each report, checks the queue, and writes down what it could not finish.\n\n"


def test_run_once_processes_the_inbox_and_sets_aside_what_cannot_be_queued(
    npumoed_home: Home, queue: Queue, make_worker: Callable[..., Worker], tmp_path: Path
) -> None:
    (npumoed_home.inbox / "report.md").write_text("# Report\n\n" + PARAGRAPH * 6)
    os.mkfifo(npumoed_home.inbox / "pipe.txt")
    (tmp_path / "secret.txt").write_text("outside the inbox")
    (npumoed_home.inbox / "link.txt").symlink_to(tmp_path / "secret.txt")
    summary = make_worker().run()
    assert dict(summary.outcomes) == {"done": 1} and summary.rejected == 2
    [job] = queue.list()
    assert job.state == "done" and (Path(job.output_dir or "") / "embeddings.npy").exists()
    assert "FIFO" in (npumoed_home.failed / "pipe.txt.error.txt").read_text()
    assert "symbolic link" in (npumoed_home.failed / "link.txt.error.txt").read_text()
    assert (tmp_path / "secret.txt").read_text() == "outside the inbox"
    row = queue.daemons.read()
    assert row is not None and row["stopped_at"] is not None and row["counters"]["done"] == 1


class Locked:
    """`os` as jobs/files.py sees it, except that opening `path` is refused (permission denied) while `locked`:
    how a file of mode 000 reads to anyone but root."""

    def __init__(self, path: Path) -> None:
        self.target, self.locked = str(path), True

    def __getattr__(self, name: str) -> object:
        return getattr(os, name)

    def open(self, path: object, *args: object, **kwargs: object) -> int:
        # The document is opened by its name within its folder's descriptor (open_regular walks the path).
        if self.locked and os.fspath(path) == os.path.basename(self.target) and "dir_fd" in kwargs:  # type: ignore[arg-type]
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), self.target)
        return os.open(path, *args, **kwargs)  # type: ignore[arg-type]


def test_a_file_refused_for_permission_stays_in_the_inbox_and_is_queued_once_it_can_be_read(
    npumoed_home: Home, queue: Queue, make_worker: Callable[..., Worker], monkeypatch: pytest.MonkeyPatch
) -> None:
    locked_path = npumoed_home.inbox / "locked.md"
    locked_path.write_text("# Locked\n\n" + PARAGRAPH * 3)
    (npumoed_home.inbox / "report.md").write_text("# Report\n\n" + PARAGRAPH * 6)
    locked = Locked(locked_path)
    monkeypatch.setattr(files, "os", locked)
    summary = make_worker().run()
    assert dict(summary.outcomes) == {"done": 1} and summary.rejected == 0
    assert locked_path.exists() and list(npumoed_home.failed.iterdir()) == []  # not set aside: a person may fix it
    assert [Path(job.path).name for job in queue.list()] == ["report.md"]
    locked.locked = False  # the person gave read permission back
    assert dict(make_worker().run().outcomes) == {"done": 1}
    assert sorted(Path(job.path).name for job in queue.list("done")) == ["locked.md", "report.md"]


def test_only_one_daemon_runs_per_home(npumoed_home: Home, make_worker: Callable[..., Worker]) -> None:
    with FileLock(npumoed_home.root / "npumoed.lock"), pytest.raises(AlreadyRunning, match="already running"):
        make_worker().run()


def test_a_job_a_killed_daemon_left_running_is_finished_by_the_next_start(
    npumoed_home: Home, queue: Queue, make_worker: Callable[..., Worker]
) -> None:
    doc = npumoed_home.inbox / "report.md"
    doc.write_text(PARAGRAPH * 3)
    worker = make_worker()
    worker.intake.take(doc)  # queued as the watcher would
    claimed = queue.claim(os.getpid(), lease_seconds=3600)  # "running", by a worker that will never return
    assert claimed is not None
    (npumoed_home.outbox / ".tmp-job1-deadbeef").mkdir()  # and its scratch folder
    worker.run()
    job = queue.get(claimed.id)
    assert job is not None and job.state == "done" and job.attempts == 2
    assert [p.name for p in npumoed_home.outbox.iterdir()] == [Path(job.output_dir or "").name]


def test_a_finished_document_seen_again_is_moved_by_policy_not_processed_again(
    npumoed_home: Home, queue: Queue, make_worker: Callable[..., Worker]
) -> None:
    text = PARAGRAPH * 3
    (npumoed_home.inbox / "report.md").write_text(text)
    make_worker("move").run()
    assert (npumoed_home.processed / "report.md").exists()
    (npumoed_home.inbox / "report.md").write_text(text)  # the same content, dropped in again
    summary = make_worker("move").run()
    assert dict(summary.outcomes) == {} and len(queue.list()) == 1
    assert sorted(p.name for p in npumoed_home.processed.iterdir()) == ["report (2).md", "report.md"]


def test_a_pause_holds_the_work_and_says_why_until_resumed(
    queue: Queue, npumoed_home: Home, make_worker: Callable[..., Worker]
) -> None:
    (npumoed_home.inbox / "report.md").write_text(PARAGRAPH * 3)
    queue.controls.set("paused", {"since": time.time()})
    seen: list[str] = []

    def resume_once_waiting() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            row = queue.daemons.read()
            if row and row["activity"] == "waiting":
                seen.append(row["reason"])
                queue.controls.set("paused", None)
                return
            time.sleep(0.05)

    resumer = threading.Thread(target=resume_once_waiting)
    resumer.start()
    summary = make_worker().run()
    resumer.join()
    assert seen and seen[0].startswith("paused by you")
    assert dict(summary.outcomes) == {"done": 1}


def mid_document(queue: Queue, action: Callable[[], None]) -> threading.Thread:
    """A thread that does `action` once the running job has made progress (within 60 s)."""

    def watch() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            running = queue.list("running")
            if running and running[0].progress > 0:
                action()
                return
            time.sleep(0.01)

    thread = threading.Thread(target=watch)
    thread.start()
    return thread


def test_stopping_hands_the_running_job_back(
    queue: Queue, npumoed_home: Home, make_worker: Callable[..., Worker]
) -> None:
    (npumoed_home.inbox / "long.md").write_text(PARAGRAPH * 40)
    worker = make_worker()

    stopper = mid_document(queue, worker.stop)
    summary = worker.run()
    stopper.join()
    [job] = queue.list()
    assert dict(summary.outcomes) == {"queued": 1}
    assert (job.state, job.attempts) == ("queued", 0)
    assert list(npumoed_home.outbox.iterdir()) == []


def test_a_batch_job_goes_back_to_the_queue_when_its_window_closes(
    queue: Queue, npumoed_home: Home, make_worker: Callable[..., Worker], tmp_path: Path
) -> None:
    document = tmp_path / "archive.md"
    document.write_text(PARAGRAPH * 40)
    job, _ = queue.add(document, sha256_of(document), model_key="m", settings_key="s", priority=BATCH,
                       batch_window="01:00-06:00")
    now = [datetime(2026, 11, 30, 5, 59)]
    worker = make_worker(clock=lambda: now[0])

    closer = mid_document(queue, lambda: now.__setitem__(0, datetime(2026, 11, 30, 6, 1)))
    summary = worker.run()
    closer.join()
    assert dict(summary.outcomes) == {"queued": 1}
    after = queue.get(job.id)
    assert (after.state, after.attempts) == ("queued", 0)
    assert list(npumoed_home.outbox.iterdir()) == []
    # the check only handed the job back; the loop wrote the window's report
    assert [p.name for p in npumoed_home.reports.iterdir()] == ["batch-20261130-0100-0600.json"]


def test_a_model_that_cannot_load_hands_the_job_back_instead_of_failing_it(
    npumoed_home: Home, queue: Queue, make_worker: Callable[..., Worker], tmp_path: Path
) -> None:
    (npumoed_home.inbox / "report.md").write_text(PARAGRAPH)

    def no_weights(settings: object) -> object:
        raise OSError("no weights here")

    worker = make_worker(loader=no_weights)
    with pytest.raises(ModelUnavailable, match="no weights here"):
        worker.run()
    [job] = queue.list()
    assert (job.state, job.attempts, job.last_error) == ("queued", 0, None)
