"""Reading the machine's power state: AC or battery, charge, Low Power Mode, thermal pressure.

Each platform says what it knows and leaves the rest None; the scheduler treats an unknown power
source as AC, so a desktop without a battery is never held back. Reading is cheap on Linux (sysfs);
on macOS AC and charge come from psutil (IOKit, no fork) and Low Power Mode from a fork of `pmset`, so
`system_power_source` caches a reading for a few seconds, and an idle daemon does not read at all.
"""

from __future__ import annotations

import ctypes
import dataclasses
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import psutil


@dataclass(frozen=True)
class PowerState:
    on_ac: bool | None  # None: unknown (no battery info) -> treat as AC
    battery_percent: float | None
    low_power_mode: bool | None  # macOS `pmset -g` lowpowermode; None elsewhere
    thermal_pressure: str | None  # "nominal", "moderate", "heavy", "critical"; None if the OS does not say

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


UNKNOWN = PowerState(on_ac=None, battery_percent=None, low_power_mode=None, thermal_pressure=None)


class PowerSource(Protocol):
    def read(self) -> PowerState: ...


class UnknownPowerSource:
    """For platforms we cannot read: everything unknown, which the scheduler treats as AC."""

    def read(self) -> PowerState:
        return UNKNOWN


class CachedPowerSource:
    """Re-reads the wrapped source at most once every `seconds` (the scheduler asks between chunks)."""

    def __init__(self, source: PowerSource, seconds: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.source = source
        self.seconds = seconds
        self.clock = clock
        self._last: tuple[float, PowerState] | None = None

    def read(self) -> PowerState:
        now = self.clock()
        if self._last is None or now - self._last[0] >= self.seconds:
            self._last = (now, self.source.read())
        return self._last[1]


# -- Linux: /sys/class/power_supply ---------------------------------------------------------------

class LinuxPowerSource:
    """AC from the mains/USB supplies' `online`, charge from the system batteries' `capacity`.

    Linux has no thermal pressure level and no Low Power Mode, so both stay None.
    """

    def __init__(self, root: Path = Path("/sys/class/power_supply")) -> None:
        self.root = root

    def read(self) -> PowerState:
        chargers: list[bool] = []
        capacities: list[float] = []
        discharging = False
        for supply in sorted(self.root.glob("*")):
            kind = _read(supply / "type")
            if kind in ("Mains", "USB") and (online := _read(supply / "online")) is not None:
                chargers.append(online == "1")
            elif kind == "Battery" and _read(supply / "scope") != "Device":  # not a mouse's battery
                if (capacity := _read(supply / "capacity")) is not None:
                    capacities.append(float(capacity))
                discharging |= _read(supply / "status") == "Discharging"
        if any(chargers):
            on_ac: bool | None = True
        elif chargers or discharging:
            on_ac = False
        else:
            on_ac = True if capacities else None  # a battery that is charging or full
        percent = sum(capacities) / len(capacities) if capacities else None
        return PowerState(on_ac=on_ac, battery_percent=percent, low_power_mode=None, thermal_pressure=None)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None


# -- macOS: pmset and the thermal pressure notification --------------------------------------------

# OSThermalNotification.h on macOS: 0 nominal, 1 moderate, 2 heavy, 3 trapping, 4 sleeping; the last two
# are both reported as "critical".
THERMAL_LEVELS = ("nominal", "moderate", "heavy", "critical", "critical")


class MacPowerSource:
    """psutil for AC and charge (`pmset -g batt` where it has no answer), `pmset -g` for Low Power Mode,
    notify(3) for thermal pressure."""

    def __init__(self, run: Callable[[list[str]], str] | None = None,
                 thermal: Callable[[], str | None] | None = None,
                 battery: Callable[[], tuple[bool, float] | None] | None = None) -> None:
        self.run = run or _run
        self.thermal = thermal or read_thermal_pressure
        self.battery = battery or read_psutil_battery

    def read(self) -> PowerState:
        on_ac, percent = self.battery() or parse_pmset_batt(self.run(["pmset", "-g", "batt"]))
        return PowerState(on_ac=on_ac, battery_percent=percent,
                          low_power_mode=parse_low_power_mode(self.run(["pmset", "-g"])),
                          thermal_pressure=self.thermal())


def read_psutil_battery() -> tuple[bool, float] | None:
    """(on AC, charge %) from psutil without a fork; None where it cannot tell (no battery, or not supported)."""
    try:
        battery = psutil.sensors_battery()
    except (AttributeError, OSError):  # AttributeError: psutil has no sensors on this platform
        return None
    if battery is None or battery.power_plugged is None:
        return None
    return bool(battery.power_plugged), float(battery.percent)


def parse_pmset_batt(text: str) -> tuple[bool | None, float | None]:
    """("Now drawing from 'AC Power'" / "'Battery Power'", the first "NN%") from `pmset -g batt`."""
    source = re.search(r"drawing from '([^']+)'", text)
    on_ac = None if source is None else source.group(1) != "Battery Power"
    percent = re.search(r"(\d{1,3})%;", text)
    return on_ac, float(percent.group(1)) if percent else None


def parse_low_power_mode(text: str) -> bool | None:
    """`lowpowermode 1` (or `powermode 1` on Macs that also have High Power Mode) in `pmset -g`."""
    found = re.search(r"^\s*(?:lowpowermode|powermode)\s+(\d)", text, re.MULTILINE)
    return None if found is None else found.group(1) == "1"


def read_thermal_pressure() -> str | None:
    """The system's thermal pressure level, read through notify(3) without forking."""
    try:
        libc = ctypes.CDLL("/usr/lib/libSystem.B.dylib")
    except OSError:
        return None
    token, state = ctypes.c_int(), ctypes.c_uint64()
    if libc.notify_register_check(b"com.apple.system.thermalpressurelevel", ctypes.byref(token)) != 0:
        return None
    try:
        if libc.notify_get_state(token, ctypes.byref(state)) != 0:
            return None
    finally:
        libc.notify_cancel(token)
    return THERMAL_LEVELS[min(state.value, len(THERMAL_LEVELS) - 1)]


def _run(command: list[str]) -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=5, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def system_power_source() -> PowerSource:
    """macOS: pmset; Linux: /sys/class/power_supply; elsewhere: unknown."""
    if sys.platform == "darwin":
        return CachedPowerSource(MacPowerSource())
    if sys.platform.startswith("linux"):
        return CachedPowerSource(LinuxPowerSource())
    return UnknownPowerSource()
