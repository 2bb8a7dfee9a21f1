"""The heartbeat: the status row, the running job's lease, and the no-progress watchdog, on a real queue."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from npumoe.daemon import heartbeat
from npumoe.daemon.heartbeat import EXIT_STUCK, Heartbeat, StallWatch, StatusRow
from npumoe.jobs.errors import Failure, Lost
from npumoe.jobs.pipeline import LOADING
from npumoe.jobs.queue.store import Job, Queue


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Exits:
    """`os` as heartbeat.py sees it, where `_exit` is recorded instead of ending the test run."""

    def __init__(self) -> None:
        self.codes: list[int] = []

    def _exit(self, code: int) -> None:
        self.codes.append(code)


def running_job(queue: Queue, worker_pid: int) -> Job:
    queue.add("/docs/report.md", "a" * 64, model_key="m", settings_key="s")
    job = queue.claim(worker_pid, lease_seconds=60)
    assert job is not None
    return job


@pytest.fixture
def beating(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Queue, StallWatch], Heartbeat]]:
    """Starts a heartbeat for this process, beating every 10 ms, on `queue` and `stall`; stopped after the test."""
    monkeypatch.setattr(heartbeat, "BEAT_SECONDS", 0.01)
    stopping = threading.Event()
    started: list[Heartbeat] = []

    def start(queue: Queue, stall: StallWatch) -> Heartbeat:
        row = StatusRow(queue, power=dict, counters=dict)
        beat = Heartbeat(queue, row, stall, pid=os.getpid(), lease_seconds=60, stopping=stopping)
        beat.start()
        started.append(beat)
        return beat

    yield start
    stopping.set()
    for beat in started:
        beat.join()


def test_the_watchdog_counts_time_without_progress_but_not_while_the_model_loads() -> None:
    clock = Clock()
    watch = StallWatch(10.0, clock=clock)
    assert watch.stalled_for() is None  # no job
    watch.start()
    clock.now = 9.0
    assert watch.stalled_for() is None
    watch.moved(LOADING)
    clock.now = 100.0
    assert watch.stalled_for() is None  # a slow load is not a hang
    watch.moved("prefill")
    clock.now = 110.5
    assert watch.stalled_for() == 10.5
    watch.paused()  # waiting for the scheduler is no stall either
    assert watch.stalled_for() is None and watch.phase == "prefill"
    watch.finish()
    assert watch.stalled_for() is None
    off = StallWatch(0.0, clock=clock)  # 0: the watchdog is off
    off.start()
    clock.now = 1e6
    assert off.stalled_for() is None


def test_a_running_job_keeps_its_lease_and_the_row_its_heartbeat(
    tmp_path: Path, beating: Callable[[Queue, StallWatch], Heartbeat], wait_for: Callable[..., bool]
) -> None:
    queue = Queue(tmp_path / "q.db")
    job = running_job(queue, os.getpid())
    beat = beating(queue, StallWatch(0.0))
    with beat.watching():
        beat.row.set("working", "", current_job=job.id)
        first = queue.daemons.read()["heartbeat_at"]
        assert wait_for(lambda: queue.daemons.read()["heartbeat_at"] > first, timeout=30)
        assert wait_for(lambda: queue.get(job.id).lease_until > (job.lease_until or 0), timeout=30)
        assert beat.ended(job.id) is None


def test_a_job_another_worker_holds_is_lost_at_its_next_check(
    tmp_path: Path, beating: Callable[[Queue, StallWatch], Heartbeat], wait_for: Callable[..., bool]
) -> None:
    queue = Queue(tmp_path / "q.db")
    job = running_job(queue, os.getpid() + 1)  # reaped and claimed again elsewhere: its lease is not ours
    beat = beating(queue, StallWatch(0.0))
    with beat.watching():
        beat.row.set("working", "", current_job=job.id)
        assert wait_for(lambda: beat.ended(job.id) is not None, timeout=30)
        assert isinstance(beat.ended(job.id), Lost)
    with beat.watching():  # the next job starts with nothing held against it
        assert beat.ended(job.id) is None


def test_a_stalled_job_is_stopped_first_and_a_process_stuck_in_a_call_gives_up_and_exits(
    tmp_path: Path, beating: Callable[[Queue, StallWatch], Heartbeat], wait_for: Callable[..., bool],
    monkeypatch: pytest.MonkeyPatch
) -> None:
    exits = Exits()
    monkeypatch.setattr(heartbeat, "os", exits)
    queue = Queue(tmp_path / "q.db")
    job = running_job(queue, os.getpid())
    clock = Clock()
    beat = beating(queue, StallWatch(10.0, clock=clock))
    with beat.watching():
        beat.row.set("working", "", current_job=job.id)
        beat.stall.moved("prefill")
        clock.now = 11.0
        assert wait_for(lambda: beat.ended(job.id) is not None, timeout=30)
        stalled = beat.ended(job.id)
        assert isinstance(stalled, Failure) and stalled.kind == "stalled" and stalled.retryable
        assert "while prefill" in str(stalled) and exits.codes == []  # asked to stop at its next check
        clock.now = 10.0 + 10.0 + 11.0  # no check reached for as long again: stuck
        assert wait_for(lambda: exits.codes, timeout=30)
    assert exits.codes[0] == EXIT_STUCK
    failed = queue.get(job.id)
    assert failed is not None and (failed.state, failed.error_kind) == ("failed", "stalled")
    assert "stuck in a call that did not return" in (failed.last_error or "")
