"""The job queue, on real SQLite files and real OS processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect, text

from npumoe.bench.queue import run_claim_benchmark
from npumoe.jobs.queue import BATCH, INTERACTIVE, Backoff, Queue
from npumoe.jobs.schema import SCHEMA_VERSION, jobs, migrate


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def add(queue: Queue, n: int, **kw: object) -> list[int]:
    return [queue.add(f"/docs/{i}", f"{i:064x}", model_key="m", settings_key="s", **kw)[0].id  # type: ignore[arg-type]
            for i in range(n)]


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def queue(tmp_path: Path, clock: Clock) -> Queue:
    q = Queue(tmp_path / "q.db", clock=clock, backoff=Backoff(base=10, cap=100))
    yield q
    q.close()


def test_database_uses_wal_and_is_private(queue: Queue) -> None:
    with queue._read.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000
    assert queue.path.stat().st_mode & 0o077 == 0


def test_same_content_model_and_settings_is_one_job(queue: Queue) -> None:
    first, created = queue.add("/a.txt", "ab" * 32, model_key="m", settings_key="s")
    again, created_again = queue.add("/copy-of-a.txt", "ab" * 32, model_key="m", settings_key="s")
    other_settings, created_other = queue.add("/a.txt", "ab" * 32, model_key="m", settings_key="t")
    assert created and not created_again and created_other
    assert again.id == first.id and again.path == "/a.txt"
    assert other_settings.id != first.id
    assert sum(queue.counts().values()) == 2


def test_claim_takes_interactive_work_before_batch_and_skips_closed_windows(queue: Queue) -> None:
    batch = queue.add("/b", "b" * 64, model_key="m", settings_key="s", priority=BATCH,
                      batch_window="01:00-06:00")[0]
    interactive = queue.add("/i", "i" * 64, model_key="m", settings_key="s", priority=INTERACTIVE)[0]
    assert queue.claim(1, lease_seconds=60).id == interactive.id
    assert queue.claim(1, lease_seconds=60) is None  # the batch job waits for its window
    assert queue.open_windows_needed() == ["01:00-06:00"]
    assert queue.claim(1, lease_seconds=60, open_windows=["01:00-06:00"]).id == batch.id


def test_failures_back_off_then_the_job_is_dead(queue: Queue, clock: Clock) -> None:
    (job_id,) = add(queue, 1, max_attempts=3)
    delays = []
    for attempt in (1, 2):
        job = queue.claim(7, lease_seconds=60)
        assert (job.id, job.attempts) == (job_id, attempt)
        assert queue.fail(job_id, 7, "boom", kind="corrupt") == "failed"
        failed = queue.get(job_id)
        delays.append(failed.run_after - clock.now)
        assert queue.claim(7, lease_seconds=60) is None  # not before run_after
        clock.now = failed.run_after
    assert 5 <= delays[0] <= 10 and 10 <= delays[1] <= 20  # base·2^(n-1), jittered into its upper half
    queue.claim(7, lease_seconds=60)
    assert queue.fail(job_id, 7, "boom again", kind="corrupt") == "dead"
    dead = queue.get(job_id)
    assert (dead.state, dead.last_error, dead.error_kind) == ("dead", "boom again", "corrupt")
    assert dead.attempts == 3
    assert queue.claim(7, lease_seconds=60) is None


def test_a_permanent_failure_is_dead_at_once(queue: Queue) -> None:
    (job_id,) = add(queue, 1)
    queue.claim(7, lease_seconds=60)
    assert queue.fail(job_id, 7, "PDF is encrypted", kind="encrypted", retryable=False) == "dead"


def test_backoff_is_capped() -> None:
    assert all(50 <= Backoff(base=10, cap=100).delay(n) <= 100 for n in range(5, 40))


def test_retry_and_cancel(queue: Queue) -> None:
    (job_id,) = add(queue, 1, max_attempts=1)
    queue.claim(7, lease_seconds=60)
    queue.fail(job_id, 7, "boom")
    assert queue.retry(job_id).state == "queued"
    assert queue.get(job_id).attempts == 0
    assert queue.cancel(job_id).state == "cancelled"
    with pytest.raises(ValueError, match="cancelled"):
        queue.cancel(job_id)
    with pytest.raises(KeyError):
        queue.retry(999)


def test_a_cancelled_running_job_is_no_longer_the_workers(queue: Queue) -> None:
    (job_id,) = add(queue, 1)
    queue.claim(7, lease_seconds=60)
    queue.cancel(job_id)
    assert not queue.heartbeat(job_id, 7, lease_seconds=60, progress=0.5)
    assert not queue.complete(job_id, 7)
    assert queue.get(job_id).state == "cancelled"


def test_heartbeat_renews_the_lease_and_records_progress(queue: Queue, clock: Clock) -> None:
    (job_id,) = add(queue, 1)
    queue.claim(7, lease_seconds=10)
    clock.now += 8
    assert queue.heartbeat(job_id, 7, lease_seconds=10, progress=0.25, detail={"chunks_done": 1})
    clock.now += 8  # past the first lease, inside the renewed one
    assert queue.reap(alive=lambda pid: True) == []
    job = queue.get(job_id)
    assert job.progress == 0.25 and job.as_dict()["detail"] == {"chunks_done": 1}
    assert not queue.heartbeat(job_id, 8, lease_seconds=10)  # another pid does not own it


def test_expired_lease_returns_the_job_then_gives_up(queue: Queue, clock: Clock) -> None:
    (job_id,) = add(queue, 1, max_attempts=2)
    for attempt in (1, 2):
        assert queue.claim(7, lease_seconds=10).attempts == attempt
        clock.now += 11
        assert queue.reap(alive=lambda pid: True) == [job_id]
    job = queue.get(job_id)
    assert job.state == "dead" and job.error_kind == "lost"  # a document that keeps killing workers stops


def test_release_hands_the_job_back_without_spending_an_attempt(queue: Queue) -> None:
    (job_id,) = add(queue, 1)
    queue.claim(7, lease_seconds=60)
    assert queue.release(job_id, 7)
    job = queue.get(job_id)
    assert (job.state, job.attempts, job.worker_pid) == ("queued", 0, None)


def test_many_processes_claim_each_job_exactly_once(tmp_path: Path) -> None:
    run = run_claim_benchmark(tmp_path / "q.db", processes=4, jobs=2000)
    assert (run.duplicates, run.lost) == (0, 0)
    assert sum(run.per_process) == 2000


CLAIM_AND_HANG = """
import os, sys, time
from npumoe.jobs.queue import Queue
job = Queue(sys.argv[1]).claim(os.getpid(), lease_seconds=float(sys.argv[2]))
print(job.id, flush=True)
time.sleep(600)
"""


def claim_in_child(database: Path, lease_seconds: float) -> tuple[subprocess.Popen[str], int]:
    child = subprocess.Popen([sys.executable, "-c", CLAIM_AND_HANG, str(database), str(lease_seconds)],
                             stdout=subprocess.PIPE, text=True)
    return child, int(child.stdout.readline())


def test_a_worker_killed_mid_job_has_its_job_reclaimed_after_its_lease(tmp_path: Path) -> None:
    queue = Queue(tmp_path / "q.db")
    (job_id,) = add(queue, 1)
    child, claimed = claim_in_child(queue.path, lease_seconds=1.0)
    assert claimed == job_id and queue.get(job_id).state == "running"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert queue.reap(alive=lambda pid: True) == []  # lease not yet expired; pid check switched off
    time.sleep(1.1)
    assert queue.reap(alive=lambda pid: True) == [job_id]
    assert queue.claim(os.getpid(), lease_seconds=60).id == job_id


def test_a_dead_worker_pid_returns_its_job_before_the_lease_ends(tmp_path: Path) -> None:
    queue = Queue(tmp_path / "q.db")
    (job_id,) = add(queue, 1)
    child, _ = claim_in_child(queue.path, lease_seconds=3600)
    assert queue.reap() == []  # alive and leased
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert queue.reap() == [job_id]
    assert queue.get(job_id).state == "queued"


def test_an_older_database_is_migrated_in_place_keeping_its_jobs(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        migrate(conn, target=1)
        conn.execute(text("INSERT INTO jobs (path, sha256, model_key, settings_key, state, run_after, "
                          "created_at, updated_at) VALUES ('/old', :sha, 'm', 's', 'queued', 0, 0, 0)"),
                     {"sha": "0" * 64})
    engine.dispose()
    queue = Queue(path)
    with queue._read.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA user_version").scalar() == SCHEMA_VERSION
        columns = {c["name"] for c in inspect(conn).get_columns("jobs")}
    assert columns == {c.name for c in jobs.columns}
    old = queue.get(1)
    assert (old.path, old.state, old.batch_window) == ("/old", "queued", None)
    assert queue.claim(1, lease_seconds=60).id == 1


def test_a_database_from_a_newer_npumoed_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "new.db"
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        conn.exec_driver_sql(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    engine.dispose()
    with pytest.raises(RuntimeError, match="newer"):
        Queue(path)


def test_status_reads_while_a_writer_holds_the_lock(tmp_path: Path) -> None:
    writer = Queue(tmp_path / "q.db")
    add(writer, 3)
    reader = Queue(writer.path, read_only=True)
    with writer._tx():  # BEGIN IMMEDIATE held: WAL readers still read
        assert reader.counts()["queued"] == 3
    with pytest.raises(PermissionError):
        reader.cancel(1)
