"""The CPU budget: how many threads the worker may use, and the background priority it runs at.

On Linux the priority is per thread, so it is applied to every thread that exists and inherited by
every thread started afterwards (torch's pool included): nice 19, SCHED_IDLE (runs only on cycles
nobody else wants) and the idle I/O class. On macOS one call moves the whole process to background
QoS (PRIO_DARWIN_BG), which lowers CPU and I/O priority and keeps it on the efficiency cores, so on
Apple silicon the worker gets as many threads as there are efficiency cores, not every core but one.
None of this can be undone without privileges, so apply it only in the process that does the work.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
from collections.abc import Callable

import psutil

from ..config import CpuConfig

log = logging.getLogger(__name__)

PRIO_DARWIN_PROCESS, PRIO_DARWIN_BG = 4, 0x1000  # sys/resource.h


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity
        return os.cpu_count() or 1


def efficiency_cores() -> int | None:
    """Apple silicon's efficiency cores (`hw.perflevel1.logicalcpu`, read without a fork); None elsewhere."""
    if sys.platform != "darwin":
        return None
    try:
        libc = ctypes.CDLL("/usr/lib/libSystem.B.dylib")
    except OSError:
        return None
    value, size = ctypes.c_int(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_int))
    if libc.sysctlbyname(b"hw.perflevel1.logicalcpu", ctypes.byref(value), ctypes.byref(size), None, 0) != 0:
        return None  # an Intel Mac: one kind of core
    return value.value or None


def worker_threads(cpu: CpuConfig, efficiency: Callable[[], int | None] = efficiency_cores) -> int:
    """Torch threads for the worker: cpu.threads, at most the cores there are; 0: all cores but one, or, at
    background priority on Apple silicon, the efficiency cores (more threads would queue on them)."""
    cores = available_cores()
    if cpu.threads < 0:
        raise ValueError(f"cpu.threads must not be negative, got {cpu.threads}")
    if cpu.threads:
        return min(cpu.threads, cores)
    if cpu.background_priority and (slow_cores := efficiency()):
        return min(slow_cores, cores)
    return max(1, cores - 1)


def apply_background_priority(cpu: CpuConfig) -> list[str]:
    """Lower the current process to background priority; returns what was applied, in words."""
    if not cpu.background_priority:
        return []
    if sys.platform == "darwin":
        return _applied({"background QoS (PRIO_DARWIN_BG)": _darwin_background})
    if sys.platform.startswith("linux"):
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
        return _applied({
            "nice 19": lambda: _each(threads, lambda t: os.setpriority(os.PRIO_PROCESS, t, 19)),
            "SCHED_IDLE": lambda: _each(threads, lambda t: os.sched_setscheduler(
                t, os.SCHED_IDLE, os.sched_param(0))),
            "idle I/O class": lambda: _each(threads, lambda t: psutil.Process(t).ionice(
                psutil.IOPRIO_CLASS_IDLE)),
        })
    log.warning("no background priority on %s", sys.platform)
    return []


def _darwin_background() -> None:
    os.setpriority(PRIO_DARWIN_PROCESS, 0, PRIO_DARWIN_BG)


def _each(threads: list[int], apply: Callable[[int], None]) -> None:
    for tid in threads:
        with contextlib.suppress(ProcessLookupError, psutil.NoSuchProcess):  # the thread ended meanwhile
            apply(tid)


def _applied(steps: dict[str, Callable[[], None]]) -> list[str]:
    done = []
    for name, step in steps.items():
        try:
            step()
        except (OSError, psutil.Error) as e:
            log.warning("could not apply %s: %s", name, e)
        else:
            done.append(name)
    return done
