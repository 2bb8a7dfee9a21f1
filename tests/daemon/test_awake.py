"""Staying awake for the overnight window: when to hold a power assertion, and the process that holds it.

The assertion commands (systemd-inhibit, caffeinate) are stand-ins on PATH that record how they were
started; the one test with the real caffeinate is marked macos.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import datetime
from pathlib import Path

import psutil
import pytest

from npumoe.daemon.config import SchedulerConfig
from npumoe.daemon.energy.awake import PowerAssertion, assertion_command, windows_to_stay_awake_for
from npumoe.daemon.energy.power import PowerState
from npumoe.daemon.scheduler import Decision, Scheduler
from npumoe.jobs.queue.store import BATCH, Queue

WINDOW = "01:00-06:00"
AC = PowerState(on_ac=True, battery_percent=90.0, low_power_mode=False, thermal_pressure="nominal")
BATTERY = PowerState(on_ac=False, battery_percent=90.0, low_power_mode=False, thermal_pressure="nominal")


# -- when ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("decision", "running", "expected"), [
    (Decision(run=True, reason="", open_windows=(WINDOW,), batch_due=(WINDOW,)), None, (WINDOW,)),
    (Decision(run=True, reason="", open_windows=(WINDOW,)), WINDOW, (WINDOW,)),  # its last job runs
    (Decision(run=True, reason="", open_windows=(WINDOW,)), None, ()),  # the queue is empty
    (Decision(run=True, reason="", open_windows=()), WINDOW, ()),  # the window closed
    (Decision(run=False, reason="paused by you", open_windows=(WINDOW,), batch_due=(WINDOW,)), None, ()),
    (Decision(run=True, reason="", open_windows=(), idle=True), None, ()),
])
def test_stay_awake_only_for_an_open_window_with_work_that_may_run(decision: Decision, running: str | None,
                                                                    expected: tuple[str, ...]) -> None:
    assert windows_to_stay_awake_for(decision, running) == expected


class Power:
    def __init__(self, state: PowerState) -> None:
        self.state = state

    def read(self) -> PowerState:
        return self.state


def test_the_scheduler_says_which_open_windows_have_batch_work(tmp_path: Path) -> None:
    now = [datetime(2026, 11, 30, 0, 30)]
    queue = Queue(tmp_path / "q.db", clock=lambda: now[0].timestamp())
    power = Power(AC)
    scheduler = Scheduler(SchedulerConfig(), queue, power=power, clock=lambda: now[0], foreground_load=lambda: 0.0)
    job, _ = queue.add("/docs/a.txt", "a" * 64, model_key="m", settings_key="s", priority=BATCH, batch_window=WINDOW)
    assert scheduler.decide().batch_due == ()  # before the window
    now[0] = datetime(2026, 11, 30, 2, 0)
    assert scheduler.decide().batch_due == (WINDOW,)
    power.state = BATTERY  # batch work waits for AC: nothing to stay awake for
    assert scheduler.decide().batch_due == ()
    power.state = AC
    claimed = queue.claim(1, lease_seconds=60, open_windows=(WINDOW,))
    assert claimed is not None and claimed.id == job.id
    queue.complete(job.id, 1)
    assert scheduler.decide().batch_due == ()  # the queue emptied


# -- the process that holds it -------------------------------------------------------------------------

def stand_in(folder: Path, name: str, body: str) -> Path:
    """An executable `name` in `folder` that records its pid and arguments in `folder/name.calls`, then `body`."""
    folder.mkdir(exist_ok=True)
    script = folder / name
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        echo "$$ $*" >> "{folder / name}.calls"
        {body}
        """))
    script.chmod(0o755)
    return folder


def calls(folder: Path, name: str) -> list[tuple[int, str]]:
    path = folder / f"{name}.calls"
    lines = path.read_text().splitlines() if path.exists() else []
    return [(int(pid), args) for pid, args in (line.split(" ", 1) for line in lines)]


def gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def fake_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "bin"
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    return folder


def test_on_linux_systemd_inhibit_holds_an_idle_lock_around_cat_until_released(fake_bin: Path) -> None:
    stand_in(fake_bin, "systemd-inhibit", 'exec cat')
    assertion = PowerAssertion(command=lambda why: assertion_command(why, platform="linux"))
    assertion.hold("batch window 01:00-06:00")
    assertion.hold("batch window 01:00-06:00")  # asked again at the next poll: still the one process
    deadline = time.monotonic() + 10
    while not calls(fake_bin, "systemd-inhibit") and time.monotonic() < deadline:
        time.sleep(0.05)
    started = calls(fake_bin, "systemd-inhibit")
    assert len(started) == 1
    pid, args = started[0]
    assert args == "--what=idle --mode=block --who=npumoed --why=batch window 01:00-06:00 cat"
    assert psutil.Process(pid).is_running() and assertion.holding == "batch window 01:00-06:00 (systemd-inhibit)"
    assertion.release()
    assert gone(pid) and assertion.holding == ""


def test_on_macos_caffeinate_waits_on_the_daemons_pid_until_released(fake_bin: Path) -> None:
    stand_in(fake_bin, "caffeinate", 'while kill -0 "$3" 2>/dev/null; do sleep 0.1; done')
    assertion = PowerAssertion(command=lambda why: assertion_command(why, platform="darwin"))
    assertion.hold("batch window 01:00-06:00")
    deadline = time.monotonic() + 10
    while not calls(fake_bin, "caffeinate") and time.monotonic() < deadline:
        time.sleep(0.05)
    [(pid, args)] = calls(fake_bin, "caffeinate")
    assert args == f"-i -w {os.getpid()}"
    assertion.release()
    assert gone(pid)


def test_no_command_means_nothing_is_held_and_it_is_not_retried_every_poll() -> None:
    asked: list[str] = []

    def none(why: str) -> None:
        asked.append(why)

    assertion = PowerAssertion(command=none)
    for _ in range(3):
        assertion.hold("batch window 01:00-06:00")
    assert asked == ["batch window 01:00-06:00"] and assertion.holding == ""
    assert assertion_command("x", platform="linux", which=lambda name: None) is None


def test_the_lock_ends_with_the_daemon_even_when_it_is_killed(fake_bin: Path, tmp_path: Path) -> None:
    stand_in(fake_bin, "systemd-inhibit", 'exec cat')
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""\
        import time
        from npumoe.daemon.energy.awake import PowerAssertion, assertion_command
        PowerAssertion(command=lambda why: assertion_command(why, platform="linux")).hold("batch window")
        time.sleep(600)
        """)], env={**os.environ})
    try:
        deadline = time.monotonic() + 30
        while not calls(fake_bin, "systemd-inhibit") and time.monotonic() < deadline:
            time.sleep(0.05)
        [(pid, _)] = calls(fake_bin, "systemd-inhibit")
        assert psutil.Process(pid).is_running()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert gone(pid)  # `cat` read the end of the pipe the killed daemon held


@pytest.mark.macos
@pytest.mark.skipif(sys.platform != "darwin", reason="the real caffeinate and pmset are macOS only")
def test_the_real_caffeinate_shows_in_pmset_assertions() -> None:
    assertion = PowerAssertion()
    assertion.hold("batch window 01:00-06:00")
    try:
        listed = subprocess.run(["pmset", "-g", "assertions"], capture_output=True, text=True, check=True).stdout
        assert "caffeinate" in listed and "PreventUserIdleSystemSleep" in listed
    finally:
        assertion.release()
