"""The job gate: the scheduler's word acted on between jobs (the power assertion, shown by `status`) and enforced on
the running job at its check (a stop, a closed batch window, a pause)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

import pytest

from npumoe.daemon.cli.status_view import render_text, snapshot
from npumoe.daemon.config import SchedulerConfig
from npumoe.daemon.energy.awake import PowerAssertion
from npumoe.daemon.energy.power import PowerState
from npumoe.daemon.gate import JobGate
from npumoe.daemon.heartbeat import Heartbeat, StallWatch, StatusRow
from npumoe.daemon.home import Home
from npumoe.daemon.scheduler import Scheduler
from npumoe.jobs.errors import Stop
from npumoe.jobs.queue.store import BATCH, Job, Queue

WINDOW = "01:00-06:00"
AC = PowerState(on_ac=True, battery_percent=90.0, low_power_mode=False, thermal_pressure="nominal")


class Power:
    def read(self) -> PowerState:
        return AC


class Recorder(PowerAssertion):
    def __init__(self) -> None:
        super().__init__(command=lambda why: None)
        self.asked: list[str] = []

    def hold(self, why: str) -> None:
        self.asked.append(why)
        self.holding = f"{why} (stand-in)"

    def release(self) -> None:
        self.asked.append("release")
        self.holding = ""


@dataclass
class World:
    queue: Queue
    gate: JobGate
    awake: Recorder
    now: list[datetime]
    stopping: threading.Event

    def batch_job(self) -> Job:
        job, _ = self.queue.add("/docs/a.txt", "a" * 64, model_key="m", settings_key="s", priority=BATCH,
                                batch_window=WINDOW)
        return job


@pytest.fixture
def world(npumoed_home: Home, queue: Queue) -> World:
    """A gate on a real queue and scheduler at 02:00, on AC, with its status row and heartbeat (not beating)."""
    now = [datetime(2026, 11, 30, 2, 0)]
    scheduler = Scheduler(SchedulerConfig(), queue, power=Power(), clock=lambda: now[0], foreground_load=lambda: 0.0)
    awake = Recorder()
    row = StatusRow(queue, power=lambda: {**scheduler.power_state(), "awake": awake.holding}, counters=dict)
    stopping = threading.Event()
    heartbeat = Heartbeat(queue, row, StallWatch(0.0), pid=os.getpid(), lease_seconds=60, stopping=stopping)
    gate = JobGate(scheduler, queue, npumoed_home, awake, row=row, heartbeat=heartbeat, stopping=stopping,
                   poll_seconds=0.01, obey_schedule=True)
    row.open(pid=os.getpid(), model="demo", backend="cpu")
    return World(queue, gate, awake, now, stopping)


def test_the_gate_holds_the_power_assertion_while_batch_work_waits_in_an_open_window_and_status_shows_it(
    world: World
) -> None:
    world.batch_job()
    world.gate.decide()
    assert world.awake.asked == [f"batch window {WINDOW}"]
    world.gate.row.write()
    shown = snapshot(world.queue)
    assert shown["daemon"]["power"]["awake"] == f"batch window {WINDOW} (stand-in)"
    assert f"keeping the computer awake: batch window {WINDOW} (stand-in)" in render_text(shown)
    assert json.loads(json.dumps(shown, default=str))["daemon"]["power"]["awake"]  # in `status --json` too

    world.now[0] = datetime(2026, 11, 30, 6, 30)  # the window closed
    world.gate.decide()
    assert world.awake.asked[-1] == "release"
    world.gate.row.write()
    assert "keeping the computer awake" not in render_text(snapshot(world.queue))


def test_the_check_hands_the_running_job_back_when_its_window_closes_or_the_daemon_stops(
    world: World, wait_for: Callable[..., bool]
) -> None:
    job = world.batch_job()

    def handed_back() -> str | None:
        try:
            world.gate.check()
        except Stop as stop:
            return str(stop)
        return None

    with world.gate.running(job):
        assert handed_back() is None  # inside its window: it goes on
        world.now[0] = datetime(2026, 11, 30, 6, 1)
        assert wait_for(handed_back, timeout=30)  # the scheduler is asked again within a moment
        assert handed_back() == f"its batch window {WINDOW} closed"
    with world.gate.running(job):
        world.now[0] = datetime(2026, 11, 30, 2, 0)
        world.stopping.set()
        assert handed_back() == "the daemon is stopping"


def test_a_pause_blocks_the_check_and_says_why_until_resumed(world: World, wait_for: Callable[..., bool]) -> None:
    job = world.batch_job()
    world.gate.row.set("working", "", current_job=job.id)
    world.queue.controls.set("paused", {"since": 0.0})
    with world.gate.running(job):
        checking = threading.Thread(target=world.gate.check)
        checking.start()
        assert wait_for(lambda: (world.queue.daemons.read() or {}).get("activity") == "waiting", timeout=30)
        assert checking.is_alive() and world.queue.daemons.read()["reason"].startswith("paused by you")
        world.queue.controls.set("paused", None)
        checking.join(timeout=30)
    assert not checking.is_alive() and world.queue.daemons.read()["activity"] == "working"
