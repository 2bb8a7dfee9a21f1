"""The processor the engine runs on: its name and feature flags, and the user cache where what the engine
builds or measures for this machine is kept.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
from functools import cache
from pathlib import Path

import platformdirs


def cache_root() -> Path:
    """`$NPUMOE_CACHE`, else the platform's user cache folder for npumoe (it may not exist yet)."""
    return Path(os.environ.get("NPUMOE_CACHE") or _platform_cache(os.environ.get("XDG_CACHE_HOME"),
                                                                   os.environ.get("HOME")))


@cache  # platformdirs costs a tenth of a millisecond, asked per kernel call; keyed by what it reads
def _platform_cache(xdg_cache_home: str | None, home: str | None) -> str:
    return platformdirs.user_cache_dir("npumoe")


@cache  # the processor does not change under a running process; reading it costs a file read or a process
def cpu_model() -> str:
    """The CPU's marketing name, or the architecture when the platform does not say."""
    match = re.search(r"^model name\s*:\s*(.+)$", _cpuinfo(), re.MULTILINE)
    if match:
        return match.group(1).strip()
    if platform.system() == "Darwin":
        found = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True)
        if found.returncode == 0 and found.stdout.strip():
            return found.stdout.strip()
    return platform.processor() or platform.machine()


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags Linux reports (empty elsewhere)."""
    match = re.search(r"^flags\s*:\s*(.+)$", _cpuinfo(), re.MULTILINE)
    return frozenset(match.group(1).split()) if match else frozenset()


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux
        return ""
