"""The processor the engine runs on: its name and feature flags, the ceiling a person may put on the instruction sets
the engine's own kernels use, and the user cache where what the engine builds or measures for this machine is kept.

`NPUMOE_MAX_CPU_ISA` narrows the engine's own kernels as `ATEN_CPU_CAPABILITY` narrows torch's and
`ONEDNN_MAX_CPU_ISA` oneDNN's: every kernel that needs an instruction set above it reports itself unavailable (so
an AVX2-only CPU's choices can be made and tested on a CPU with more). Its levels run in oneDNN's order, each
implying those before it.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
from functools import cache
from pathlib import Path

import platformdirs

MAX_ISA_VARIABLE = "NPUMOE_MAX_CPU_ISA"
# Lowest first; the kernels name the level they need: AVX-VNNI (256-bit), AVX-512, AVX512-VNNI, AVX512-BF16, AMX.
ISA_LEVELS = ("avx2", "avx2_vnni", "avx512", "avx512_vnni", "avx512_bf16", "amx")


def isa_ceiling_refuses(level: str) -> str | None:
    """Why `$NPUMOE_MAX_CPU_ISA` keeps a kernel that needs instruction set `level` (one of ISA_LEVELS) from running,
    or None when it is unset or allows it; ValueError on a value that is not a level."""
    if level not in ISA_LEVELS:
        raise ValueError(f"an instruction set level must be one of {', '.join(ISA_LEVELS)}, not {level!r}")
    ceiling = os.environ.get(MAX_ISA_VARIABLE, "").strip().lower()
    if not ceiling:
        return None
    if ceiling not in ISA_LEVELS:
        raise ValueError(f"{MAX_ISA_VARIABLE} must be one of {', '.join(ISA_LEVELS)}, not {ceiling!r}")
    if ISA_LEVELS.index(level) > ISA_LEVELS.index(ceiling):
        return f"{MAX_ISA_VARIABLE}={ceiling} excludes {level}"
    return None


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
