"""The CPU budget (threads, background priority) and what the daemon measures (CPU seconds, energy, load)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from npumoe.daemon.config import CpuConfig
from npumoe.daemon.energy import priority
from npumoe.daemon.energy.measure import ForegroundLoad, Meter, NoEnergy, system_energy_counter

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux scheduling classes")

BURN = "import time\nend = time.process_time() + {seconds}\nwhile time.process_time() < end: pass\n"


def burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


@pytest.mark.parametrize(("cores", "threads", "expected"), [(8, 0, 7), (2, 0, 1), (1, 0, 1), (8, 3, 3),
                                                            (2, 6, 2)])
def test_worker_threads_leave_a_core_free_by_default(monkeypatch: pytest.MonkeyPatch, cores: int,
                                                     threads: int, expected: int) -> None:
    monkeypatch.setattr(priority, "available_cores", lambda: cores)
    assert priority.worker_threads(CpuConfig(threads=threads), efficiency=lambda: None) == expected


@pytest.mark.parametrize(("threads", "background", "expected"), [(0, True, 2), (0, False, 9), (4, True, 4)])
def test_at_background_priority_on_apple_silicon_the_worker_gets_the_efficiency_cores(
        monkeypatch: pytest.MonkeyPatch, threads: int, background: bool, expected: int) -> None:
    monkeypatch.setattr(priority, "available_cores", lambda: 10)  # an 8P+2E Mac
    asked = []

    def two_efficiency_cores() -> int:
        asked.append(True)
        return 2

    cpu = CpuConfig(threads=threads, background_priority=background)
    assert priority.worker_threads(cpu, efficiency=two_efficiency_cores) == expected
    assert asked == ([True] if threads == 0 and background else [])


@pytest.mark.skipif(sys.platform == "darwin", reason="a Mac may have efficiency cores")
def test_elsewhere_there_are_no_efficiency_cores_to_prefer() -> None:
    assert priority.efficiency_cores() is None


@pytest.mark.macos
@pytest.mark.skipif(sys.platform != "darwin" or platform.machine() != "arm64", reason="Apple silicon only")
def test_apple_silicon_reports_its_efficiency_cores() -> None:
    found = priority.efficiency_cores()
    assert found is not None and 0 < found < (os.cpu_count() or 0)


def test_negative_threads_are_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"cpu\.threads must not be negative"):
        priority.worker_threads(CpuConfig(threads=-1))


def test_background_priority_can_be_turned_off() -> None:
    assert priority.apply_background_priority(CpuConfig(background_priority=False)) == []


@linux_only
def test_background_priority_reaches_every_thread_old_and_new() -> None:
    # In a child process: nice 19 cannot be undone, and this one must not slow the test run.
    script = textwrap.dedent("""
        import json, os, threading, psutil
        from npumoe.daemon.config import CpuConfig
        from npumoe.daemon.energy.priority import apply_background_priority

        def state():
            tid = threading.get_native_id()
            return [os.getpriority(os.PRIO_PROCESS, tid), os.sched_getscheduler(tid) == os.SCHED_IDLE,
                    psutil.Process(tid).ionice().ioclass == psutil.IOPRIO_CLASS_IDLE]

        seen, go = {}, threading.Event()
        def before():
            go.wait(); seen["before"] = state()
        early = threading.Thread(target=before); early.start()
        applied = apply_background_priority(CpuConfig())
        go.set(); early.join()
        late = threading.Thread(target=lambda: seen.update(after=state())); late.start(); late.join()
        print(json.dumps({"applied": applied, "main": state(), **seen}))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["applied"] == ["nice 19", "SCHED_IDLE", "idle I/O class"]
    for thread in ("main", "before", "after"):
        assert report[thread] == [19, True, True], thread


def test_meter_counts_cpu_seconds_of_this_process_and_its_children() -> None:
    with Meter(NoEnergy("none here")) as meter:
        burn(0.3)
        subprocess.run([sys.executable, "-c", BURN.format(seconds=0.3)], check=True, timeout=60)
    assert meter.cpu_seconds >= 0.55
    assert meter.wall_seconds >= meter.cpu_seconds * 0.5
    assert meter.energy_joules is None and meter.energy_source == "none here"


def test_meter_reports_the_energy_a_counter_gives() -> None:
    class Counter:
        description = "a fake counter"
        value = 100.0

        def read(self) -> float | None:
            self.value += 2.5
            return self.value

    with Meter(Counter()) as meter:
        pass
    assert meter.energy_joules == 2.5
    assert meter.energy_source == "a fake counter"


@pytest.mark.skipif(sys.platform == "darwin", reason="macOS measures energy per process")
def test_without_nvml_energy_is_unavailable_not_guessed() -> None:
    counter = system_energy_counter()
    if not isinstance(counter, NoEnergy):
        pytest.skip(f"this machine measures energy: {counter.description}")
    with Meter() as meter:
        burn(0.05)
    assert meter.energy_joules is None and meter.energy_source.startswith("unavailable")


@pytest.mark.gpu
def test_nvml_energy_is_measured_on_an_nvidia_machine() -> None:
    with Meter() as meter:
        time.sleep(1.0)
    assert meter.energy_source.startswith("NVML"), meter.energy_source
    assert meter.energy_joules is not None and meter.energy_joules > 0


def _share(process: psutil.Process, before: float, seconds: float) -> float:
    t = process.cpu_times()
    return (t.user + t.system - before) / (seconds * (psutil.cpu_count() or 1))


@pytest.mark.slow  # CPU burners measured over real seconds, at the mercy of other load (make chaos)
def test_foreground_load_counts_other_processes_but_not_our_own_children() -> None:
    load = ForegroundLoad(window=0.1)
    load()
    ours = subprocess.Popen([sys.executable, "-c", BURN.format(seconds=30)])
    # Started through a shell that exits at once, so the burner is nobody's child of ours.
    theirs_pid = int(subprocess.run(
        ["sh", "-c", f'"{sys.executable}" -c "{BURN.format(seconds=30)}" >/dev/null 2>&1 & echo $!'],
        capture_output=True, text=True, check=True).stdout)
    theirs = psutil.Process(theirs_pid)
    try:
        mine = psutil.Process(ours.pid)
        time.sleep(0.3)
        load()  # start the measured interval
        start_ours, start_theirs = (sum(p.cpu_times()[:2]) for p in (mine, theirs))
        started = time.monotonic()
        time.sleep(2.0)
        measured = load()
        seconds = time.monotonic() - started
        our_share, their_share = _share(mine, start_ours, seconds), _share(theirs, start_theirs, seconds)
    finally:
        ours.kill()
        theirs.kill()
        ours.wait()
    assert their_share > 0.2 and our_share > 0.2  # both really ran
    # The other process counts in full; ours not at all, whatever else the machine is doing.
    assert measured >= their_share - 0.1
    assert measured <= 1.0 - our_share + 0.1


def test_foreground_load_asked_again_quickly_returns_the_last_value_without_sleeping() -> None:
    clock = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock[0] += seconds

    load = ForegroundLoad(window=1.0, clock=lambda: clock[0], sleep=sleep)
    first = load()
    assert slept == [1.0]  # the first call waits for something to average over
    clock[0] = 2.5
    second = load()
    clock[0] = 2.6
    assert load() == second and slept == [1.0]
    assert 0.0 <= first <= 1.0
