"""When the daemon may work, and if not, why: one decision, one reason in words.

The rules, each switched by a key of [scheduler] in the config, in the order they are checked:

    a fault of the machine (disk full, …)    ─► wait until a probe finds it cleared (always, whatever the config)
    paused by the person (`npumoed pause`)   ─► wait
    on battery (run_on_battery = false)      ─► wait
    battery below min_battery_percent        ─► wait
    Low Power Mode (respect_low_power_mode)  ─► wait
    thermal pressure heavy or worse          ─► wait
    foreground load > max_foreground_load    ─► wait
    otherwise                                ─► run; batch jobs only inside their window
                                                 (and only on AC when batch_requires_ac)

Interactive documents outrank batch ones in the queue's claim order, so a document added by hand
runs before the rest of an overnight batch. `decide` is cheap enough to call between chunks: the
power source caches its reading and the foreground load is sampled at most once a second. While no
job could be claimed, `idle` answers from the queue and the clock alone, without either.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from npumoe.jobs.faults import MachineFault
from npumoe.jobs.queue.store import Queue

from .batch import BatchWindow
from .config import SchedulerConfig
from .energy.measure import ForegroundLoad
from .energy.power import PowerSource, PowerState, system_power_source

log = logging.getLogger(__name__)

# Apple's own load advisory turns "bad" at heavy; moderate comes and goes under any sustained load.
THERMAL_WAIT = ("heavy", "critical")


@dataclass(frozen=True)
class Decision:
    run: bool  # the global rules (pause, power, thermal, foreground load) allow work now
    reason: str  # "" when run; else words for `npumoed status`, e.g. "paused by you", "on battery (42%)"
    open_windows: tuple[str, ...]  # batch windows open now (pass to Queue.claim(open_windows=...))
    held: str = ""  # why queued batch work waits even when run is True, e.g. "batch work waits for 01:00-06:00"
    batch_due: tuple[str, ...] = ()  # of open_windows, those with batch work waiting in them
    idle: bool = False  # no job could be claimed now: decided without reading the power source or the load


class ClosedWindow(NamedTuple):
    window: str
    started: datetime
    ended: datetime


class Scheduler:
    def __init__(self, config: SchedulerConfig, queue: Queue, *, power: PowerSource | None = None,
                 clock: Callable[[], datetime] | None = None,
                 foreground_load: Callable[[], float] | None = None) -> None:
        self.config = config
        self.queue = queue
        self.power = power or system_power_source()
        self.clock = clock or datetime.now
        self.foreground_load = foreground_load or ForegroundLoad()
        self._power: PowerState | None = None
        self._opened: dict[str, datetime] = {}  # batch windows open by the clock, and when they opened
        self._closed: list[ClosedWindow] = []
        self._fault: MachineFault | None = None
        self._fault_words = ""
        self._next_probe = 0.0

    def decide(self) -> Decision:
        now = self.clock()
        needed = set(self.queue.open_windows_needed())
        if paused := self._paused_reason():  # nothing runs: the power source and the load are left alone
            by_clock = self._windows_by_clock(needed, now)
            return Decision(run=False, reason=paused, open_windows=by_clock, held=_held(needed, by_clock))
        power = self._power = self.power.read()
        open_windows, held = self._batch_windows(needed, now, power)
        reason = self._wait_reason(power)
        return Decision(run=not reason, reason=reason, open_windows=open_windows, held=held,
                        batch_due=tuple(w for w in open_windows if w in needed))

    def idle(self) -> Decision | None:
        """The decision when no job could be claimed now, made from the queue and the clock alone; None when
        one could (then ask `decide`). An idle daemon asks this, so it never reads the power source (on a Mac,
        possibly a fork) or samples the load while there is nothing to do."""
        now = self.clock()
        needed = set(self.queue.open_windows_needed())
        by_clock = self._windows_by_clock(needed, now)
        if self.queue.has_runnable(by_clock):
            return None
        reason = self._paused_reason()
        return Decision(run=not reason, reason=reason, open_windows=(), held=_held(needed, by_clock), idle=True)

    def hold(self, fault: MachineFault) -> None:
        """All work waits until `fault` has cleared (probed at most once per `poll_seconds`)."""
        self._fault = fault
        self._fault_words = f"{fault}; waiting until that is put right (no document is blamed)"
        self._next_probe = time.monotonic() + self.config.poll_seconds

    def fault_reason(self) -> str:
        """Why work waits for the machine, in words; "" when it does not (any more)."""
        if self._fault is not None and time.monotonic() >= self._next_probe:
            if self._fault.cleared():
                log.info("cleared: %s; going on", self._fault)
                self._fault = None
            else:
                self.hold(self._fault)  # the words again: the free space shown is the space free now
        return self._fault_words if self._fault is not None else ""

    def power_state(self) -> dict[str, Any]:
        """The last power reading (the first is taken now), for the daemon's status row and `npumoed status`."""
        if self._power is None:
            self._power = self.power.read()
        return self._power.as_dict()

    def closed_windows(self) -> list[ClosedWindow]:
        """Batch windows that closed since the last call (write their reports with write_batch_report)."""
        closed, self._closed = self._closed, []
        return closed

    def _paused_reason(self) -> str:
        """Why nothing may run whatever the power and the load: a fault of the machine, or the person's pause."""
        if fault := self.fault_reason():
            return fault
        if paused := self.queue.controls.get("paused"):
            since = paused_since(paused)
            return f"paused by you since {since:%H:%M}" if since else "paused by you"
        return ""

    def _wait_reason(self, power: PowerState) -> str:
        """Why the power state or the load holds the work back (the pause is checked before the power is read)."""
        c = self.config
        percent = power.battery_percent
        if power.on_ac is False and not c.run_on_battery:
            return f"on battery ({percent:.0f}%)" if percent is not None else "on battery"
        if power.on_ac is False and percent is not None and percent < c.min_battery_percent:
            return f"battery low ({percent:.0f}% < {c.min_battery_percent}%)"
        if c.respect_low_power_mode and power.low_power_mode:
            return "Low Power Mode is on"
        if c.respect_thermal_pressure and power.thermal_pressure in THERMAL_WAIT:
            return f"thermal pressure is {power.thermal_pressure}"
        load = self.foreground_load()
        if load > c.max_foreground_load:
            return f"foreground load {load:.1%} > {c.max_foreground_load:.0%}"
        return ""

    def _batch_windows(self, needed: set[str], now: datetime, power: PowerState) -> tuple[tuple[str, ...], str]:
        """The windows open now for the jobs waiting on them, and why the others' jobs wait."""
        open_now = self._windows_by_clock(needed, now)
        held = [waiting] if (waiting := _held(needed, open_now)) else []
        if open_now and self.config.batch_requires_ac and power.on_ac is False:
            held.append(f"batch window {', '.join(open_now)} is open, but batch work waits for AC power")
            open_now = ()
        return open_now, "; ".join(held)

    def _windows_by_clock(self, needed: set[str], now: datetime) -> tuple[str, ...]:
        """The windows open by the clock alone, tracked so that a window that closes is reported once, even if
        it was held shut for lack of AC power."""
        by_clock = {w for w in needed | self._opened.keys() if _is_open(w, now)}
        for window in sorted(self._opened.keys() - by_clock):
            self._closed.append(ClosedWindow(window, self._opened.pop(window), now))
        for window in by_clock - self._opened.keys():
            self._opened[window] = BatchWindow.parse(window).last_opening(now)
        return tuple(sorted(by_clock))


def _held(needed: set[str], open_now: tuple[str, ...]) -> str:
    waiting = sorted(needed - set(open_now))
    return f"batch work waits for {', '.join(waiting)}" if waiting else ""


def paused_since(paused: Any) -> datetime | None:
    """When the person paused, from the "paused" switch ({"since": unix time}); None if it does not say."""
    since = paused.get("since") if isinstance(paused, dict) else None
    return datetime.fromtimestamp(since) if isinstance(since, int | float) else None


def _is_open(window: str, now: datetime) -> bool:
    try:
        return BatchWindow.parse(window).contains(now)
    except ValueError as e:  # a window written by hand into the database; its jobs never run
        log.warning("ignoring jobs queued for a bad batch window: %s", e)
        return False
