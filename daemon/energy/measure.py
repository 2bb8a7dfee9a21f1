"""What the daemon costs: CPU seconds and energy per job, and how busy the machine is without it.

CPU seconds come from getrusage (this process, all its threads, plus reaped children such as the
text extractor). Energy is read only where the platform measures it: per-process energy on macOS,
GPU board energy through NVML on NVIDIA; elsewhere it is recorded as unavailable, never estimated.
"""

from __future__ import annotations

import ctypes
import functools
import os
import resource
import sys
import time
from collections.abc import Callable
from typing import Protocol

import psutil


class EnergyCounter(Protocol):
    description: str  # what the reading covers, or why there is none

    def read(self) -> float | None: ...  # joules since some fixed point; None: cannot be read


class NoEnergy:
    def __init__(self, description: str) -> None:
        self.description = description

    def read(self) -> float | None:
        return None


class MacProcessEnergy:
    """ri_energy_nj from proc_pid_rusage(RUSAGE_INFO_V6): this process's own energy, children excluded."""

    description = "macOS per-process energy (proc_pid_rusage), this process only"
    FLAVOR_V6 = 6
    # sys/resource.h, struct rusage_info_v6: 16 bytes of ri_uuid, then 56 uint64 fields; ri_energy_nj is
    # the 41st (after 36 fields up to ri_flags and ri_user_ptime, ri_system_ptime, ri_pinstructions, ri_pcycles).
    ENERGY_NJ = 40

    class _Info(ctypes.Structure):
        _fields_ = (("uuid", ctypes.c_uint8 * 16), ("fields", ctypes.c_uint64 * 56))

    def __init__(self) -> None:
        self._libc = ctypes.CDLL("/usr/lib/libSystem.B.dylib")

    def read(self) -> float | None:
        info = self._Info()
        if self._libc.proc_pid_rusage(os.getpid(), self.FLAVOR_V6, ctypes.byref(info)) != 0:
            return None
        return info.fields[self.ENERGY_NJ] / 1e9


class NvmlEnergy:
    """nvmlDeviceGetTotalEnergyConsumption (mJ since the driver loaded), summed over the GPUs.

    It is board energy: it includes every process on the GPU and the GPU's idle draw.
    """

    def __init__(self) -> None:
        self._nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if self._nvml.nvmlInit_v2() != 0:
            raise OSError("nvmlInit failed")
        count = ctypes.c_uint()
        if self._nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0 or count.value == 0:
            raise OSError("NVML sees no GPU")
        self._devices = []
        for index in range(count.value):
            handle = ctypes.c_void_p()
            if self._nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
                raise OSError(f"NVML cannot open GPU {index}")
            self._devices.append(handle)
        if self.read() is None:
            raise OSError("this GPU has no NVML energy counter (needs Volta or newer)")
        self.description = f"NVML board energy of {count.value} GPU(s), all processes on them"

    def read(self) -> float | None:
        total = 0
        for handle in self._devices:
            millijoules = ctypes.c_ulonglong()
            if self._nvml.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(millijoules)) != 0:
                return None
            total += millijoules.value
        return total / 1000


@functools.cache
def system_energy_counter() -> EnergyCounter:
    """The best energy reading this machine offers (opened once per process)."""
    if sys.platform == "darwin":
        try:
            mac = MacProcessEnergy()
            if mac.read() is not None:
                return mac
        except (OSError, AttributeError):
            pass
        return NoEnergy("unavailable: this macOS gives no per-process energy")
    try:
        return NvmlEnergy()
    except (OSError, AttributeError):
        return NoEnergy(f"unavailable on {_platform_name()} without NVML")


def _platform_name() -> str:
    return "Linux" if sys.platform.startswith("linux") else sys.platform


def cpu_seconds() -> float:
    """User + system CPU seconds of this process (every thread), plus its reaped children."""
    usage = map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return sum(u.ru_utime + u.ru_stime for u in usage)


class Meter:
    """Measures a block: `with Meter() as m: ...` then m.cpu_seconds, m.wall_seconds, m.energy_joules."""

    def __init__(self, energy: EnergyCounter | None = None) -> None:
        self._energy = energy if energy is not None else system_energy_counter()
        self.energy_source = self._energy.description
        self.cpu_seconds = 0.0
        self.wall_seconds = 0.0
        self.energy_joules: float | None = None

    def __enter__(self) -> Meter:
        self._start = (cpu_seconds(), time.perf_counter(), self._energy.read())
        return self

    def __exit__(self, *exc: object) -> None:
        cpu, wall, energy = self._start
        self.cpu_seconds = cpu_seconds() - cpu
        self.wall_seconds = time.perf_counter() - wall
        end = self._energy.read()
        self.energy_joules = None if energy is None or end is None else end - energy


class ForegroundLoad:
    """The fraction of all cores busy with processes other than this one and its children.

    Each call averages over the time since the previous sample; a call sooner than `window` seconds
    after it returns the previous value, so asking between every chunk costs almost nothing. Only
    the first call may sleep (up to `window`), to have something to average over.
    """

    BUSY = ("user", "nice", "system", "irq", "softirq")  # user already holds guest time

    def __init__(self, window: float = 1.0, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.window = window
        self.clock = clock
        self.sleep = sleep
        self.cores = psutil.cpu_count() or 1
        self._me = psutil.Process()
        self._last = self._sample()
        self._value: float | None = None

    def __call__(self) -> float:
        elapsed = self.clock() - self._last[0]
        if elapsed < self.window:
            if self._value is not None:
                return self._value
            self.sleep(self.window - elapsed)
        sample = self._sample()
        (t0, busy0, own0), (t1, busy1, own1) = self._last, sample
        others = (busy1 - busy0) - (own1 - own0)
        self._value = min(max(others / ((t1 - t0) * self.cores), 0.0), 1.0)
        self._last = sample
        return self._value

    def _sample(self) -> tuple[float, float, float]:
        times = psutil.cpu_times()
        busy = sum(getattr(times, name, 0.0) for name in self.BUSY)
        return self.clock(), busy, self._own_cpu_seconds()

    def _own_cpu_seconds(self) -> float:
        """This process and its live descendants; each one's reaped children are in children_*."""
        total = 0.0
        for process in [self._me, *self._me.children(recursive=True)]:
            try:
                t = process.cpu_times()
            except psutil.Error:  # exited between listing and reading
                continue
            total += t.user + t.system + t.children_user + t.children_system
        return total
