"""The job queue, on real SQLite files, a real PostgreSQL server and real OS processes.

Every test of the queue's behaviour runs once per dialect (the `queue_location` fixture); the tests of one
dialect's own machinery (SQLite's WAL and file migrations, PostgreSQL's wake-ups) say so in their names.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import psutil
import pytest
from sqlalchemy import create_engine, inspect, text, update
from sqlalchemy.exc import DBAPIError
from support.postgres_server import PostgresServer

from npumoe.bench.service.queue import run_claim_benchmark
from npumoe.jobs.errors import IdentityInUse
from npumoe.jobs.queue.identity import IDENTITY_FILE
from npumoe.jobs.queue.schema import SCHEMA_VERSION, jobs, migrate, schema_version
from npumoe.jobs.queue.store import BATCH, FREE_HANDBACKS, HANDBACKS, INTERACTIVE, Backoff, Queue


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
def queue(queue_location: Path | str, clock: Clock) -> Iterator[Queue]:
    q = Queue(queue_location, clock=clock, backoff=Backoff(base=10, cap=100))
    yield q
    q.close()


def test_sqlite_database_uses_wal_and_is_private(tmp_path: Path) -> None:
    queue = Queue(tmp_path / "q.db")
    with queue.db.read() as conn:
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


def test_a_job_handed_back_for_a_machine_fault_goes_last_then_backs_off_then_spends_an_attempt(
    queue: Queue, clock: Clock
) -> None:
    faulty, other = add(queue, 2, max_attempts=2)
    clock.now += 1
    assert queue.claim(7, lease_seconds=60).id == faulty
    assert queue.hand_back(faulty, 7, "I/O error in /docs") == "queued"
    clock.now += 1
    assert queue.claim(7, lease_seconds=60).id == other  # the job handed back no longer comes first
    assert queue.complete(other, 7)
    for spent in (1, 2):
        for count in range(2 if spent == 1 else 1, HANDBACKS + 1):  # the first cycle's first hand-back was above
            clock.now = queue.get(faulty).run_after
            assert queue.claim(7, lease_seconds=60).id == faulty
            assert queue.hand_back(faulty, 7, "I/O error in /docs") == "queued"
            job = queue.get(faulty)
            assert (job.attempts, job.handbacks, job.error_kind) == (spent - 1, count, "machine")
            assert (job.run_after > clock.now) == (count > FREE_HANDBACKS)  # free hand-backs wait for nothing
        clock.now = queue.get(faulty).run_after
        assert queue.claim(7, lease_seconds=60).id == faulty
        assert queue.hand_back(faulty, 7, "I/O error in /docs") == ("failed" if spent == 1 else "dead")
        job = queue.get(faulty)
        assert (job.attempts, job.handbacks, job.last_error) == (spent, 0, "I/O error in /docs")
    assert queue.retry(faulty).handbacks == 0


@pytest.mark.slow  # four processes racing (make chaos, beside the several-machines run)
def test_many_processes_claim_each_job_exactly_once(queue_location: Path | str) -> None:
    run = run_claim_benchmark(queue_location, processes=4, jobs=2000)
    assert (run.duplicates, run.lost) == (0, 0)
    assert sum(run.per_process) == 2000


CLAIM_AND_HANG = """
import os, sys, time
from npumoe.jobs.queue.store import Queue
job = Queue(sys.argv[1]).claim(os.getpid(), lease_seconds=float(sys.argv[2]))
print(job.id, flush=True)
time.sleep(600)
"""


def claim_in_child(location: str, lease_seconds: float) -> tuple[subprocess.Popen[str], int]:
    child = subprocess.Popen([sys.executable, "-c", CLAIM_AND_HANG, location, str(lease_seconds)],
                             stdout=subprocess.PIPE, text=True)
    return child, int(child.stdout.readline())


def test_a_worker_killed_mid_job_has_its_job_reclaimed_after_its_lease(queue_location: Path | str) -> None:
    queue = Queue(queue_location)
    (job_id,) = add(queue, 1)
    child, claimed = claim_in_child(queue.location, lease_seconds=1.0)
    assert claimed == job_id and queue.get(job_id).state == "running"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert queue.reap(alive=lambda pid: True) == []  # lease not yet expired; pid check switched off
    time.sleep(1.1)
    assert queue.reap(alive=lambda pid: True) == [job_id]
    assert queue.claim(os.getpid(), lease_seconds=60).id == job_id


def test_a_dead_worker_pid_returns_its_job_before_the_lease_ends(queue_location: Path | str) -> None:
    queue = Queue(queue_location)
    (job_id,) = add(queue, 1)
    child, _ = claim_in_child(queue.location, lease_seconds=3600)
    assert queue.reap() == []  # alive and leased
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert queue.reap() == [job_id]
    assert queue.get(job_id).state == "queued"


def test_an_older_sqlite_database_is_migrated_in_place_keeping_its_jobs(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        migrate(conn, target=1)
        conn.execute(text("INSERT INTO jobs (path, sha256, model_key, settings_key, state, run_after, "
                          "created_at, updated_at) VALUES ('/old', :sha, 'm', 's', 'queued', 0, 0, 0)"),
                     {"sha": "0" * 64})
    engine.dispose()
    queue = Queue(path)
    with queue.db.read() as conn:
        assert conn.exec_driver_sql("PRAGMA user_version").scalar() == SCHEMA_VERSION
        columns = {c["name"] for c in inspect(conn).get_columns("jobs")}
    assert columns == {c.name for c in jobs.columns}
    old = queue.get(1)
    assert (old.path, old.state, old.batch_window) == ("/old", "queued", None)
    assert queue.claim(1, lease_seconds=60).id == 1


def test_a_sqlite_database_from_a_newer_npumoed_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "new.db"
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        conn.exec_driver_sql(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    engine.dispose()
    with pytest.raises(RuntimeError, match="newer"):
        Queue(path)


def test_status_reads_while_a_writer_holds_the_lock(queue_location: Path | str) -> None:
    writer = Queue(queue_location)
    add(writer, 3)
    reader = Queue(writer.location, read_only=True)
    with writer.db.tx():  # SQLite: BEGIN IMMEDIATE held, and WAL readers still read
        assert reader.counts()["queued"] == 3
    with pytest.raises(PermissionError):
        reader.cancel(1)


def lose_the_next_answer(queue: Queue, monkeypatch: pytest.MonkeyPatch) -> None:
    """The next write commits, and then the connection drops before its answer arrives (a server restart, a
    network cut): the caller sees the dropped connection and runs the statement again."""
    real_tx, answers_lost = queue.db.tx, []

    @contextmanager
    def tx() -> Iterator[object]:
        with real_tx() as conn:
            yield conn
        if not answers_lost:
            answers_lost.append(True)
            raise DBAPIError("COMMIT", None, ConnectionResetError("connection lost"), connection_invalidated=True)

    monkeypatch.setattr(queue.db, "tx", tx)


def test_a_claim_replayed_after_its_answer_was_lost_takes_no_second_job(
    queue: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = add(queue, 2)
    lose_the_next_answer(queue, monkeypatch)
    claimed = queue.claim(7, lease_seconds=60)
    assert (claimed.id, claimed.attempts) == (first, 1)
    assert (queue.get(second).state, queue.counts()["running"]) == ("queued", 1)


def test_a_complete_replayed_after_its_answer_was_lost_reads_as_done(
    queue: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    (job_id,) = add(queue, 1)
    queue.claim(7, lease_seconds=60)
    lose_the_next_answer(queue, monkeypatch)
    assert queue.complete(job_id, 7, output_dir="/outbox/a")
    assert queue.get(job_id).state == "done"


CLAIM_ON_A_SLOW_CLOCK = """
import sys, time
real = time.time
time.time = lambda: real() - 3600  # this machine's clock is an hour behind
from npumoe.jobs.queue.store import Queue
queue = Queue(sys.argv[1], host="slow")
job = queue.claim(1, lease_seconds=60)
print(job.id if job else "no job", flush=True)
"""


def test_postgresql_leases_run_on_the_servers_clock_not_the_machines(postgres: PostgresServer) -> None:
    url = postgres.new_database()
    beta = Queue(url, host="beta")
    (job_id,) = add(beta, 1)
    claimed = subprocess.run([sys.executable, "-c", CLAIM_ON_A_SLOW_CLOCK, url], capture_output=True, text=True,
                             check=True)
    assert claimed.stdout.strip() == str(job_id)  # on its own clock the job is not due for another hour
    assert beta.reap() == []  # the slow machine's lease runs for its 60 s, not an hour in the past
    job = beta.get(job_id)
    assert (job.state, job.worker_host) == ("running", "slow")
    beta.close()


# -- several machines on one PostgreSQL queue ---------------------------------------------------------------


@pytest.fixture
def machines(postgres: PostgresServer) -> Iterator[tuple[Queue, Queue, Clock]]:
    """Two machines' views of one fresh PostgreSQL queue, on one clock."""
    url, clock = postgres.new_database(), Clock()
    alpha, beta = Queue(url, host="alpha", clock=clock), Queue(url, host="beta", clock=clock)
    yield alpha, beta, clock
    alpha.close()
    beta.close()


def a_dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_machines_dedupe_globally_and_never_share_a_claim(machines: tuple[Queue, Queue, Clock]) -> None:
    alpha, beta, _ = machines
    job, created = alpha.add("/shared/a.pdf", "a" * 64, model_key="m", settings_key="s")
    again, created_again = beta.add("/shared/copy.pdf", "a" * 64, model_key="m", settings_key="s")
    assert created and not created_again and again.id == job.id
    claimed = alpha.claim(7, lease_seconds=60)
    assert claimed.id == job.id and (claimed.worker_host, claimed.worker_pid) == ("alpha", 7)
    assert beta.claim(7, lease_seconds=60) is None
    # The same pid on another machine is another worker: it owns nothing of alpha's.
    assert not beta.heartbeat(job.id, 7, lease_seconds=60) and not beta.complete(job.id, 7)
    assert alpha.complete(job.id, 7, output_dir="/shared/outbox/a")
    done = beta.get(job.id)
    assert (done.state, done.worker_host, done.output_dir) == ("done", "alpha", "/shared/outbox/a")


def test_another_machines_worker_is_reaped_by_lease_expiry_only(machines: tuple[Queue, Queue, Clock]) -> None:
    alpha, beta, clock = machines
    (job_id,) = add(alpha, 1)
    alpha.claim(a_dead_pid(), lease_seconds=60)
    assert beta.reap() == []  # beta cannot ask after alpha's processes; the lease still runs
    clock.now += 61
    assert beta.reap() == [job_id]
    assert "on alpha" in beta.get(job_id).last_error


def test_a_dead_pid_on_the_same_machine_is_reaped_before_its_lease_ends(machines: tuple[Queue, Queue, Clock]) -> None:
    alpha, beta, _ = machines
    (job_id,) = add(alpha, 1)
    alpha.claim(a_dead_pid(), lease_seconds=3600)
    assert beta.reap() == []
    assert alpha.reap() == [job_id]


def test_a_live_pid_that_started_after_the_claim_is_another_process(machines: tuple[Queue, Queue, Clock]) -> None:
    alpha, _, _ = machines
    (job_id,) = add(alpha, 1)
    claimed = alpha.claim(os.getpid(), lease_seconds=3600)
    assert claimed.worker_started == pytest.approx(psutil.Process().create_time())
    assert alpha.reap() == []  # this very process: alive, and the one that claimed
    with alpha.db.tx() as conn:  # as if this pid had been reused since a worker that started earlier claimed
        conn.execute(update(jobs).values(worker_started=claimed.worker_started - 3600))
    assert alpha.reap() == [job_id]


def test_a_job_pinned_to_its_machine_is_claimed_there_only(machines: tuple[Queue, Queue, Clock]) -> None:
    alpha, beta, _ = machines
    job, _ = alpha.add("/Users/a/inbox/local.md", "l" * 64, model_key="m", settings_key="s", pinned=True)
    assert job.pinned_host == "alpha"
    assert beta.claim(1, lease_seconds=60) is None
    assert alpha.claim(1, lease_seconds=60).id == job.id


def test_each_machine_and_home_has_its_own_daemon_row(machines: tuple[Queue, Queue, Clock]) -> None:
    alpha, beta, _ = machines
    alpha_second_home = Queue(alpha.location, host="alpha", home="/srv/second")
    for queue, pid in ((alpha, 1), (beta, 2), (alpha_second_home, 3)):
        queue.daemons.write(pid=pid, started_at=10.0, heartbeat_at=11.0, activity="idle", counters={"done": pid})
    beta.daemons.write(activity="working", current_job=5)
    assert [(w["host"], w["pid"], w["activity"]) for w in alpha.daemons.all()] == [
        ("alpha", 1, "idle"), ("alpha", 3, "idle"), ("beta", 2, "working")]
    assert (beta.daemons.read()["pid"], alpha_second_home.daemons.read()["counters"]) == (2, {"done": 3})
    alpha_second_home.close()


def test_postgresql_wakes_idle_workers_on_other_machines_also_after_a_server_restart(
    machines: tuple[Queue, Queue, Clock], postgres: PostgresServer
) -> None:
    alpha, beta, _ = machines
    woken, stop = threading.Semaphore(0), threading.Event()
    listener = alpha.listen(woken.release, stop)
    try:
        assert woken.acquire(timeout=30)  # once on connecting: whatever was queued before went unannounced
        assert not woken.acquire(timeout=0.5)  # and then only when told
        add(beta, 1)
        assert woken.acquire(timeout=30)
        postgres.restart()
        assert woken.acquire(timeout=60)  # reconnected
        beta.add("/after-restart", "r" * 64, model_key="m", settings_key="s")  # beta's pool reconnects too
        assert woken.acquire(timeout=30)
    finally:
        stop.set()
        listener.join(timeout=10)
    assert not listener.is_alive()


def test_postgresql_schema_version_is_kept_and_a_newer_one_refused(postgres: PostgresServer) -> None:
    url = postgres.new_database()
    starters = [threading.Thread(target=lambda: Queue(url).close()) for _ in range(3)]  # machines starting at once
    for starter in starters:
        starter.start()
    for starter in starters:
        starter.join()
    queue = Queue(url)
    with queue.db.tx() as conn:
        assert schema_version(conn) == SCHEMA_VERSION
        assert {c["name"] for c in inspect(conn).get_columns("jobs")} == {c.name for c in jobs.columns}
        conn.exec_driver_sql(f"UPDATE npumoed_schema SET version = {SCHEMA_VERSION + 1}")
    with pytest.raises(RuntimeError, match="newer"):
        Queue(url)


def test_a_home_on_a_shared_queue_is_known_by_an_identity_made_once_and_kept(
        postgres: PostgresServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not by its host name, which cloned machines share and macOS changes with the network."""
    url = postgres.new_database()
    monkeypatch.setattr(socket, "gethostname", lambda: "mac")
    first_home, cloned_name = tmp_path / "a", tmp_path / "b"
    first_home.mkdir(), cloned_name.mkdir()
    first, other = Queue(url, home=first_home), Queue(url, home=cloned_name)
    monkeypatch.setattr(socket, "gethostname", lambda: "mac-on-another-network")
    again = Queue(url, home=first_home)
    assert first.host.startswith("mac-") and other.host.startswith("mac-") and first.host != other.host
    assert again.host == first.host == (first_home / IDENTITY_FILE).read_text().strip()
    job, _ = first.add("/inbox/a.md", "a" * 64, model_key="m", settings_key="s", pinned=True)
    assert other.claim(1, lease_seconds=60) is None  # a machine of the same host name does not take it
    assert again.claim(1, lease_seconds=60).id == job.id  # the same machine, renamed, does
    for queue in (first, other, again):
        queue.close()


def test_a_daemon_does_not_start_beside_a_live_one_with_its_identity(postgres: PostgresServer) -> None:
    """A home copied whole to another machine (a cloned image) carries its identity file along."""
    url = postgres.new_database()
    here, clone = (Queue(url, host="mac-3f2a", home="/Users/p/npumoed") for _ in range(2))
    here.daemons.write(pid=1, started_at=10.0, activity="idle")
    running, _ = here.add("/inbox/a.md", "a" * 64, model_key="m", settings_key="s")
    assert here.claim(1, lease_seconds=60).id == running.id
    for what_a_daemon_does in (clone.reap, partial(clone.claim, 2, lease_seconds=60),
                               partial(clone.daemons.write, pid=2, started_at=11.0, activity="idle")):
        with pytest.raises(IdentityInUse, match="already known as 'mac-3f2a'"):
            what_a_daemon_does()
    assert here.daemons.read()["pid"] == 1  # the live one's row is untouched
    assert here.get(running.id).state == "running"  # and its job is not taken back
    here.close()  # the first one stops (or is killed: its connection goes with it)
    clone.daemons.write(pid=2, started_at=12.0, activity="idle")
    assert clone.daemons.read()["pid"] == 2
    clone.close()
