"""The scheduler's rules, one by one, with a fake power source, a fake clock and a fake foreground load."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

import psutil
import pytest
from support.sample_meta import document_meta

from npumoe.daemon.batch import BatchWindow, write_batch_report
from npumoe.daemon.config import SchedulerConfig, load_config
from npumoe.daemon.energy.power import (
    CachedPowerSource,
    LinuxPowerSource,
    MacPowerSource,
    PowerState,
    parse_low_power_mode,
    parse_pmset_batt,
    read_psutil_battery,
)
from npumoe.daemon.home import Home
from npumoe.daemon.intake import enqueue
from npumoe.daemon.samples import write_samples
from npumoe.daemon.scheduler import Scheduler
from npumoe.jobs.queue.store import BATCH, INTERACTIVE, Queue

AC = PowerState(on_ac=True, battery_percent=80.0, low_power_mode=False, thermal_pressure="nominal")
BATTERY = dataclasses.replace(AC, on_ac=False, battery_percent=42.0)
DESKTOP = PowerState(on_ac=None, battery_percent=None, low_power_mode=None, thermal_pressure=None)
NOON = datetime(2025, 3, 4, 12, 0)


class FakePower:
    def __init__(self, state: PowerState = AC) -> None:
        self.state = state
        self.reads = 0

    def read(self) -> PowerState:
        self.reads += 1
        return self.state


class World:
    """A queue, a power source, a clock and a foreground load, all set by the test."""

    def __init__(self, tmp_path: Path, **config: object) -> None:
        self.now = NOON
        self.load = 0.0
        self.power = FakePower()
        self.queue = Queue(tmp_path / "db.sqlite", clock=lambda: self.now.timestamp())
        self.scheduler = Scheduler(SchedulerConfig(**config), self.queue, power=self.power,
                                   clock=lambda: self.now, foreground_load=lambda: self.load)
        self.added = 0

    def add(self, *, priority: int = INTERACTIVE, window: str | None = None) -> int:
        self.added += 1
        job, _ = self.queue.add(f"/docs/{self.added}.txt", f"{self.added:064x}", model_key="demo",
                                settings_key="s", priority=priority, batch_window=window)
        return job.id


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


def test_runs_when_nothing_holds_it_back(world: World) -> None:
    decision = world.scheduler.decide()
    assert decision.run and decision.reason == "" and decision.held == ""


def test_pause_holds_everything_until_resume(world: World) -> None:
    world.queue.controls.set("paused", {"since": NOON.timestamp()})
    paused = world.scheduler.decide()
    assert not paused.run and paused.reason == "paused by you since 12:00"
    world.queue.controls.set("paused", None)
    assert world.scheduler.decide().run


def test_paused_it_reads_neither_the_power_source_nor_the_load(world: World) -> None:
    world.add()
    world.queue.controls.set("paused", {"since": NOON.timestamp()})
    world.load = 0.9  # would be a reason of its own, if it were sampled
    assert world.scheduler.decide().reason == "paused by you since 12:00"
    assert world.power.reads == 0


def test_pause_outranks_every_other_reason(world: World) -> None:
    world.power.state = dataclasses.replace(BATTERY, low_power_mode=True)
    world.queue.controls.set("paused", {"since": NOON.timestamp()})
    assert world.scheduler.decide().reason.startswith("paused by you")


def test_waits_on_battery_by_default(world: World) -> None:
    world.power.state = BATTERY
    decision = world.scheduler.decide()
    assert not decision.run and decision.reason == "on battery (42%)"


def test_on_battery_when_allowed_it_still_waits_below_the_threshold(tmp_path: Path) -> None:
    world = World(tmp_path, run_on_battery=True, min_battery_percent=50)
    world.power.state = BATTERY
    assert world.scheduler.decide().reason == "battery low (42% < 50%)"
    world.power.state = dataclasses.replace(BATTERY, battery_percent=65.0)
    assert world.scheduler.decide().run


def test_a_low_battery_on_ac_does_not_hold_it_back(world: World) -> None:
    world.power.state = dataclasses.replace(AC, battery_percent=5.0)
    assert world.scheduler.decide().run


def test_unknown_power_counts_as_ac(world: World) -> None:
    world.power.state = DESKTOP
    world.now = datetime(2025, 3, 4, 2, 0)
    world.add(priority=BATCH, window="01:00-06:00")
    decision = world.scheduler.decide()
    assert decision.run and decision.open_windows == ("01:00-06:00",)


def test_low_power_mode_waits_unless_told_to_ignore_it(tmp_path: Path) -> None:
    strict, lax = World(tmp_path / "a"), World(tmp_path / "b", respect_low_power_mode=False)
    for world in (strict, lax):
        world.power.state = dataclasses.replace(AC, low_power_mode=True)
    assert strict.scheduler.decide().reason == "Low Power Mode is on"
    assert lax.scheduler.decide().run


@pytest.mark.parametrize(("pressure", "runs"), [("nominal", True), ("moderate", True), ("heavy", False),
                                                ("critical", False), (None, True)])
def test_thermal_pressure_heavy_or_worse_waits(world: World, pressure: str | None, runs: bool) -> None:
    world.power.state = dataclasses.replace(AC, thermal_pressure=pressure)
    decision = world.scheduler.decide()
    assert decision.run == runs
    assert decision.reason == ("" if runs else f"thermal pressure is {pressure}")


def test_thermal_pressure_is_ignored_when_told(tmp_path: Path) -> None:
    world = World(tmp_path, respect_thermal_pressure=False)
    world.power.state = dataclasses.replace(AC, thermal_pressure="critical")
    assert world.scheduler.decide().run


def test_waits_while_the_foreground_is_busier_than_the_threshold(tmp_path: Path) -> None:
    world = World(tmp_path, max_foreground_load=0.5)
    world.load = 0.8
    assert world.scheduler.decide().reason == "foreground load 80.0% > 50%"
    world.load = 0.5
    assert world.scheduler.decide().run


def test_batch_jobs_wait_for_their_window(world: World) -> None:
    world.add(priority=BATCH, window="01:00-06:00")
    world.now = datetime(2025, 3, 4, 0, 59)
    before = world.scheduler.decide()
    assert before.run and before.open_windows == () and before.held == "batch work waits for 01:00-06:00"
    world.now = datetime(2025, 3, 4, 1, 0)
    assert world.scheduler.decide().open_windows == ("01:00-06:00",)
    world.now = datetime(2025, 3, 4, 6, 0)
    assert world.scheduler.decide().open_windows == ()


@pytest.mark.parametrize(("hour", "is_open"), [(21, False), (22, True), (23, True), (0, True), (5, True),
                                               (6, False), (12, False)])
def test_a_window_across_midnight(world: World, hour: int, is_open: bool) -> None:
    world.add(priority=BATCH, window="22:00-06:00")
    world.now = datetime(2025, 3, 4, hour, 0)
    assert world.scheduler.decide().open_windows == (("22:00-06:00",) if is_open else ())


def test_on_battery_no_window_is_open_when_batch_requires_ac(tmp_path: Path) -> None:
    world = World(tmp_path, run_on_battery=True, min_battery_percent=0)
    world.add(priority=BATCH, window="01:00-06:00")
    world.now = datetime(2025, 3, 4, 2, 0)
    world.power.state = BATTERY
    decision = world.scheduler.decide()
    assert decision.run and decision.open_windows == ()
    assert decision.held == "batch window 01:00-06:00 is open, but batch work waits for AC power"


def test_batch_may_run_on_battery_when_it_does_not_require_ac(tmp_path: Path) -> None:
    world = World(tmp_path, run_on_battery=True, min_battery_percent=0, batch_requires_ac=False)
    world.add(priority=BATCH, window="01:00-06:00")
    world.now = datetime(2025, 3, 4, 2, 0)
    world.power.state = BATTERY
    assert world.scheduler.decide().open_windows == ("01:00-06:00",)


def test_an_interactive_add_outranks_overnight_batch_work(world: World) -> None:
    world.now = datetime(2025, 3, 4, 2, 0)
    world.add(priority=BATCH, window="01:00-06:00")
    world.add(priority=BATCH, window="01:00-06:00")
    interactive = world.add()
    decision = world.scheduler.decide()
    claimed = world.queue.claim(1, lease_seconds=60, open_windows=decision.open_windows)
    assert claimed is not None and claimed.id == interactive


def test_a_closing_window_is_reported_once_with_its_opening_time(world: World) -> None:
    world.add(priority=BATCH, window="22:00-06:00")
    world.now = datetime(2025, 3, 4, 23, 30)
    world.scheduler.decide()
    assert world.scheduler.closed_windows() == []
    world.now = datetime(2025, 3, 5, 6, 0, 5)
    world.scheduler.decide()
    closed = world.scheduler.closed_windows()
    assert [(c.window, c.started, c.ended) for c in closed] == [
        ("22:00-06:00", datetime(2025, 3, 4, 22, 0), datetime(2025, 3, 5, 6, 0, 5))]
    world.scheduler.decide()
    assert world.scheduler.closed_windows() == []


def test_power_state_is_the_last_reading(world: World) -> None:
    world.power.state = BATTERY
    world.scheduler.decide()
    reads = world.power.reads
    assert world.scheduler.power_state() == {"on_ac": False, "battery_percent": 42.0,
                                             "low_power_mode": False, "thermal_pressure": "nominal"}
    assert world.power.reads == reads


@pytest.mark.parametrize("text", ["1:00-6:00", "01:00", "25:00-06:00", "01:00-06:60", ""])
def test_a_bad_window_is_a_clear_error(text: str) -> None:
    with pytest.raises(ValueError, match="must look like HH:MM-HH:MM"):
        BatchWindow.parse(text)


def test_a_whole_day_window() -> None:
    assert BatchWindow.parse("00:00-00:00").contains(NOON)


# -- the batch report ------------------------------------------------------------------------------

def test_the_batch_report_covers_the_jobs_of_that_night(tmp_path: Path) -> None:
    world = World(tmp_path)
    home = Home(tmp_path / "home").ensure()
    window = "01:00-06:00"

    def finish(at: datetime, meta: dict[str, object] | None) -> None:
        world.now = at
        job = world.queue.claim(7, lease_seconds=60, open_windows=[window])
        assert job is not None
        out = home.outbox / f"job{job.id}"
        if meta is not None:
            out.mkdir()
            (out / "meta.json").write_bytes(document_meta(**meta).to_json())
            world.queue.complete(job.id, 7, output_dir=str(out))
        else:
            world.queue.fail(job.id, 7, "extractor crashed", retryable=False)

    world.now = datetime(2025, 3, 2, 12, 0)
    for _ in range(5):
        world.add(priority=BATCH, window=window)
    world.add()  # interactive: not part of any batch
    world.queue.cancel(6)
    finish(datetime(2025, 3, 3, 2, 0), {"tokens": 999, "cpu_seconds": 9.0, "energy_joules": None})  # last night
    finish(datetime(2025, 3, 4, 1, 30), {"tokens": 100, "cpu_seconds": 2.5, "energy_joules": None})
    finish(datetime(2025, 3, 4, 2, 30), {"tokens": 50, "cpu_seconds": 1.25, "energy_joules": 12.0})
    finish(datetime(2025, 3, 4, 3, 0), None)  # dead
    # job 5 is still queued when the window closes

    path = write_batch_report(world.queue, home, window, datetime(2025, 3, 4, 1, 0), datetime(2025, 3, 4, 6, 0))

    report = json.loads(path.read_text())
    assert path.parent == home.reports and path.name == "batch-20250304-0100-0600.json"
    assert report["counts"] == {"queued": 1, "running": 0, "done": 2, "failed": 0, "dead": 1, "cancelled": 0}
    assert [d["id"] for d in report["documents"]] == [2, 3, 4, 5]
    assert report["tokens"] == 150 and report["cpu_seconds"] == 3.75
    assert report["energy_joules"] == 12.0 and report["energy_measured_documents"] == 1


def test_without_any_energy_reading_the_report_says_unavailable(tmp_path: Path) -> None:
    world = World(tmp_path)
    home = Home(tmp_path / "home").ensure()
    world.add(priority=BATCH, window="01:00-06:00")
    path = write_batch_report(world.queue, home, "01:00-06:00", datetime(2025, 3, 4, 1), datetime(2025, 3, 4, 6))
    report = json.loads(path.read_text())
    assert report["energy_joules"] is None and report["energy_measured_documents"] == 0


# -- reading the power state ----------------------------------------------------------------------

def _supply(root: Path, name: str, **files: str) -> None:
    (root / name).mkdir(parents=True)
    for key, value in files.items():
        (root / name / key).write_text(value + "\n")


def test_linux_laptop_on_battery(tmp_path: Path) -> None:
    _supply(tmp_path, "AC", type="Mains", online="0")
    _supply(tmp_path, "BAT0", type="Battery", capacity="37", status="Discharging")
    _supply(tmp_path, "hidpp_battery_0", type="Battery", scope="Device", capacity="5", status="Discharging")
    state = LinuxPowerSource(tmp_path).read()
    assert (state.on_ac, state.battery_percent) == (False, 37.0)
    assert state.low_power_mode is None and state.thermal_pressure is None


def test_linux_laptop_charging_over_usb_c(tmp_path: Path) -> None:
    _supply(tmp_path, "ucsi-source-psy-USBC000:001", type="USB", online="1")
    _supply(tmp_path, "BAT1", type="Battery", capacity="64", status="Charging")
    assert LinuxPowerSource(tmp_path).read().on_ac is True


def test_linux_machine_without_supplies_is_unknown(tmp_path: Path) -> None:
    assert LinuxPowerSource(tmp_path).read() == DESKTOP


# Output in the format pmset prints (from its documentation and public transcripts, not captured here).
PMSET_BATT = "Now drawing from 'Battery Power'\n -InternalBattery-0 (id=4653155)\t42%; discharging; " \
             "3:21 remaining present: true\n"
PMSET_BATT_DESKTOP = "Now drawing from 'AC Power'\n"
PMSET_G = "System-wide power settings:\nCurrently in use:\n standby              1\n lowpowermode         1\n" \
          " sleep                1\n"


def test_pmset_output_is_read() -> None:
    assert parse_pmset_batt(PMSET_BATT) == (False, 42.0)
    assert parse_pmset_batt(PMSET_BATT_DESKTOP) == (True, None)
    assert parse_pmset_batt("") == (None, None)
    assert parse_low_power_mode(PMSET_G) is True
    assert parse_low_power_mode(PMSET_G.replace("lowpowermode         1", "lowpowermode         0")) is False
    assert parse_low_power_mode(" powermode            1\n") is True
    assert parse_low_power_mode("") is None


def test_mac_power_source_combines_pmset_and_thermal_pressure() -> None:
    outputs = {"pmset -g batt": PMSET_BATT, "pmset -g": PMSET_G}
    source = MacPowerSource(run=lambda cmd: outputs[" ".join(cmd)], thermal=lambda: "heavy", battery=lambda: None)
    assert source.read() == PowerState(on_ac=False, battery_percent=42.0, low_power_mode=True,
                                       thermal_pressure="heavy")


def test_mac_power_source_reads_ac_and_charge_from_psutil_without_running_pmset_batt() -> None:
    ran: list[str] = []

    def run(command: list[str]) -> str:
        ran.append(" ".join(command))
        return PMSET_G

    source = MacPowerSource(run=run, thermal=lambda: "nominal", battery=lambda: (True, 64.0))
    assert source.read() == PowerState(on_ac=True, battery_percent=64.0, low_power_mode=True,
                                       thermal_pressure="nominal")
    assert ran == ["pmset -g"]  # Low Power Mode only


class Battery(NamedTuple):  # the fields of psutil.sensors_battery()'s answer
    percent: float
    secsleft: int
    power_plugged: bool | None


@pytest.mark.parametrize(("answer", "expected"), [
    (Battery(percent=37, secsleft=600, power_plugged=False), (False, 37.0)),
    (Battery(percent=90, secsleft=-2, power_plugged=True), (True, 90.0)),
    (Battery(percent=90, secsleft=-2, power_plugged=None), None),  # cannot tell: ask pmset
    (None, None),  # no battery
])
def test_psutil_battery_is_read_where_it_answers(monkeypatch: pytest.MonkeyPatch, answer: object,
                                                 expected: tuple[bool, float] | None) -> None:
    calls = []
    monkeypatch.setattr(psutil, "sensors_battery", lambda: calls.append(1) or answer)
    assert read_psutil_battery() == expected
    assert calls == [1]


def test_the_power_reading_is_cached_for_a_while() -> None:
    clock = [0.0]
    inner = FakePower()
    cached = CachedPowerSource(inner, seconds=10, clock=lambda: clock[0])
    cached.read()
    clock[0] = 9.9
    cached.read()
    assert inner.reads == 1
    clock[0] = 10.0
    cached.read()
    assert inner.reads == 2


# -- pause on a real daemon ------------------------------------------------------------------------

def _detail(queue: Queue, job_id: int) -> dict[str, object]:
    job = queue.get(job_id)
    assert job is not None
    return {"state": job.state, **(json.loads(job.detail) if job.detail else {})}


def npumoed(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "npumoe.daemon", *args], capture_output=True, text=True,
                          timeout=120)


def _wait(condition: Callable[[], bool], what: str, daemon: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert daemon.poll() is None, f"the daemon exited with status {daemon.returncode} waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s"
        time.sleep(0.1)


@pytest.mark.slow  # a real daemon paused in real time (make chaos); the engine's and worker's pause tests are fast
def test_pause_stops_a_running_daemon_within_one_chunk_and_resume_lets_it_go_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = Home(tmp_path / "home").ensure()
    monkeypatch.setenv("NPUMOED_HOME", str(home.root))
    # Neither the other work on this machine nor idle priority may hold the daemon back: only the pause.
    (home.root / "config.toml").write_text("[scheduler]\nmax_foreground_load = 1.0\npoll_seconds = 0.5\n"
                                           "[cpu]\nbackground_priority = false\n")
    config = load_config()
    long_log = next(p for p in write_samples(tmp_path / "docs") if p.name == "night-shift-log.txt")
    queue = Queue(home.database)
    job, _ = enqueue(queue, long_log, config)
    daemon = subprocess.Popen([sys.executable, "-m", "npumoe.daemon", "run"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        chunk = config.model.chunk_tokens
        _wait(lambda: int(_detail(queue, job.id).get("tokens_done") or 0) >= chunk, "first chunk", daemon)

        assert npumoed("pause").returncode == 0
        at_pause = int(_detail(queue, job.id).get("tokens_done") or 0)
        _wait(lambda: ((queue.daemons.read() or {}).get("reason") or "").startswith("paused by you"),
              "pause", daemon)
        settled = _detail(queue, job.id)
        time.sleep(2.0)  # four of the daemon's polls
        assert _detail(queue, job.id) == settled
        assert settled["state"] == "running"
        assert int(settled.get("tokens_done") or 0) - at_pause <= chunk

        assert npumoed("resume").returncode == 0
        _wait(lambda: int(_detail(queue, job.id).get("tokens_done") or 0) > int(settled.get("tokens_done") or 0),
              "progress after resume", daemon)
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)
        queue.close()
