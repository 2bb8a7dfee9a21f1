"""An idle daemon costs nothing: no database write, no power reading (a fork of pmset on a Mac), no process.

The first test counts in this process (statements on the worker's write connection, power readings, spawned
assertions); the slow one watches a real `npumoed run` for 60 s with strace.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.exc import OperationalError

from npumoe.daemon import heartbeat
from npumoe.daemon.config import Config, CpuConfig, SchedulerConfig
from npumoe.daemon.energy.awake import PowerAssertion
from npumoe.daemon.energy.power import UNKNOWN, PowerState
from npumoe.daemon.home import Home
from npumoe.daemon.scheduler import Scheduler
from npumoe.daemon.worker import Worker
from npumoe.jobs.queue.store import BATCH, Queue

NOON = datetime(2026, 11, 30, 12, 0)
IDLE_SECONDS = 60  # how long the real daemon is watched


class CountingPower:
    def __init__(self) -> None:
        self.reads = 0

    def read(self) -> PowerState:
        self.reads += 1
        return UNKNOWN


class Writes:
    """Every statement the worker's queue runs on its write connection (each one is inside BEGIN IMMEDIATE)."""

    def __init__(self, queue: Queue) -> None:
        self.statements: list[str] = []
        event.listen(queue.db.writer, "before_cursor_execute", self._seen)

    def _seen(self, _conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        self.statements.append(statement.split()[0])


def wait_until(condition: Callable[[], object], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_an_idle_daemon_writes_nothing_reads_no_power_and_starts_no_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heartbeat, "BEAT_SECONDS", 0.02)  # a heartbeat every 20 ms: 50 chances a second
    home = Home(tmp_path / "home").ensure()
    queue = Queue(home.database)
    power = CountingPower()
    spawned: list[list[str]] = []
    config = Config(scheduler=SchedulerConfig(poll_seconds=0.02),
                    cpu=CpuConfig(threads=1, background_priority=False))
    scheduler = Scheduler(config.scheduler, queue, power=power, clock=lambda: NOON, foreground_load=lambda: 0.0)
    awake = PowerAssertion(command=lambda why: ["true"], spawn=lambda argv, **_: spawned.append(argv))
    worker = Worker(config, home, queue, scheduler=scheduler, awake=awake)
    writes = Writes(queue)
    runner = threading.Thread(target=worker.run)
    runner.start()
    try:
        wait_until(lambda: (queue.daemons.read() or {}).get("activity") == "idle")
        started = (len(writes.statements), power.reads)
        time.sleep(1.5)  # ~75 polls and heartbeats
        idle = (len(writes.statements), power.reads)

        # The counter sees a write as soon as there is something to say: batch work for a closed window.
        Queue(home.database).add("/docs/night.txt", "1" * 64, model_key="m", settings_key="s", priority=BATCH,
                                 batch_window="01:00-06:00")
        wait_until(lambda: queue.daemons.read()["reason"] == "batch work waits for 01:00-06:00")
        told = len(writes.statements)
        time.sleep(0.5)
        after = (len(writes.statements), power.reads)
    finally:
        worker.stop()
        runner.join(timeout=30)
    assert started[0] > 0 and started[1] == 1  # the start wrote the status row and read the power source once
    assert idle == started  # idle: not one statement on the write connection, no power reading
    assert told > idle[0]
    assert after == (told, started[1])  # said once; a job that cannot run yet is still nothing to do
    assert spawned == []


# -- a real daemon under strace ------------------------------------------------------------------------

LINE = re.compile(r"^(?P<pid>\d+) +(?P<time>\d+\.\d+) (?P<call>\w+)\((?P<args>.*)")
WRITES = ("write", "pwrite64", "writev", "pwritev", "pwritev2", "ftruncate", "unlink", "rename", "renameat2")
SPAWNS = ("fork", "vfork", "clone", "clone3", "execve")


def count_activity(trace: str, home: Path, since: float, until: float) -> tuple[list[str], list[str]]:
    """(writes to files in the home, process starts) that strace saw between the two times."""
    writes, spawns = [], []
    for line in trace.splitlines():
        found = LINE.match(line)
        if not found or not since <= float(found["time"]) < until:
            continue
        call, args = found["call"], found["args"]
        if call in WRITES and str(home) in args:
            writes.append(f"{call}({args[:120]}")
        elif call in SPAWNS and "CLONE_THREAD" not in args:  # a thread is no process
            spawns.append(f"{call}({args[:120]}")
    return writes, spawns


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("strace") is None or not sys.platform.startswith("linux"),
                    reason="needs strace (apt-get install strace)")
def test_a_real_idle_daemon_neither_forks_nor_writes_for_a_minute(
        home: Path, configure: Callable[[str], Path], tmp_path: Path) -> None:
    configure("[scheduler]\npoll_seconds = 5.0\n[cpu]\nbackground_priority = false\n")
    trace_file = tmp_path / "strace.txt"
    calls = "process," + ",".join(WRITES)
    daemon = subprocess.Popen(
        ["strace", "-f", "-y", "-qq", "-ttt", "-e", f"trace={calls}", "-o", str(trace_file),
         sys.executable, "-m", "npumoe.daemon", "run"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "NPUMOED_HOME": str(home)})
    try:
        queue: Queue | None = None

        def idle() -> bool:
            nonlocal queue
            if queue is None and (home / "npumoed.db").exists():
                queue = Queue(home / "npumoed.db", read_only=True)
            try:
                return queue is not None and (queue.daemons.read() or {}).get("activity") == "idle"
            except OperationalError:  # the daemon is still creating the tables
                return False

        wait_until(idle, timeout=120)
        pid = queue.daemons.read()["pid"]  # type: ignore[union-attr,index]
        queue.close()  # type: ignore[union-attr]
        since = time.time() + 1.0  # past the write that said "idle"
        time.sleep(IDLE_SECONDS + 1.0)
        until = time.time()
        os.kill(pid, signal.SIGINT)  # the daemon, not strace, which would only detach
        daemon.wait(timeout=60)
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
    trace = trace_file.read_text(errors="replace")
    startup_writes, _ = count_activity(trace, home, 0.0, since)
    writes, spawns = count_activity(trace, home, since, until)
    print(f"\nidle {until - since:.0f} s: {len(writes)} write(s) to the home, {len(spawns)} process start(s); "
          f"{len(startup_writes)} write(s) while starting")
    assert startup_writes  # the counter does see the daemon's writes
    assert (writes, spawns) == ([], [])
