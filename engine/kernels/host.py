"""The processor the engine runs on: its name and feature flags, the ceiling a person may put on the instruction sets
the engine's own kernels use, and the user cache where what the engine builds or measures for this machine is kept.

x86 flags come from /proc/cpuinfo's "flags"; Arm's from its "Features" on Linux (where that line is missing, as
under qemu-user, which shows the host's cpuinfo, from the kernel's hardware capabilities, getauxval) and from
sysctl's hw.optional.arm.FEAT_* on macOS.

`NPUMOE_MAX_CPU_ISA` narrows the engine's own x86 kernels as `ATEN_CPU_CAPABILITY` narrows torch's and
`ONEDNN_MAX_CPU_ISA` oneDNN's: every kernel that needs an instruction set above it reports itself unavailable (so
an AVX2-only CPU's choices can be made and tested on a CPU with more). Its levels run in oneDNN's order, each
implying those before it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import subprocess
from functools import cache
from pathlib import Path

import platformdirs

MAX_ISA_VARIABLE = "NPUMOE_MAX_CPU_ISA"
# Every ceiling on the instruction sets that code run here uses: the engine's own kernels', torch's and oneDNN's.
ISA_CEILINGS = (MAX_ISA_VARIABLE, "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
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


def machine_fingerprint() -> dict[str, str]:
    """What a figure measured here depends on besides the work: the CPU's name, a digest of its feature flags (on
    a VM the name is often the generic "Intel(R) Xeon(R) Processor" whatever runs underneath) and the
    instruction-set ceilings set for this process."""
    features = " ".join(sorted(cpu_flags() | arm_features()))
    ceilings = ";".join(f"{name}={os.environ.get(name, '').strip().lower()}" for name in ISA_CEILINGS)
    return {"cpu": cpu_model(), "cpu_flags": hashlib.sha256(features.encode()).hexdigest()[:12],
            "isa_ceilings": ceilings}


@cache
def cpu_flags() -> frozenset[str]:
    """The x86 CPU feature flags Linux reports (empty elsewhere; qemu-user shows an Arm process the host's)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return frozenset()
    match = re.search(r"^flags\s*:\s*(.+)$", _cpuinfo(), re.MULTILINE)
    return frozenset(match.group(1).split()) if match else frozenset()


# Arm features the engine's kernels use, by Linux's names in cpuinfo, with macOS's sysctl name and Linux's
# hardware capability bit (AT_HWCAP or AT_HWCAP2, arch/arm64/include/uapi/asm/hwcap.h) for each.
ARM_FEATURES = {"asimddp": ("FEAT_DotProd", 16, 1 << 20), "i8mm": ("FEAT_I8MM", 26, 1 << 13),
                "bf16": ("FEAT_BF16", 26, 1 << 14)}


@cache
def arm_features() -> frozenset[str]:
    """Which of ARM_FEATURES this arm64 CPU has (empty on other CPUs)."""
    if platform.machine().lower() not in ("arm64", "aarch64"):
        return frozenset()
    if platform.system() == "Darwin":
        return frozenset(name for name, (sysctl, _, _) in ARM_FEATURES.items() if _sysctl_flag(sysctl))
    listed = arm_features_listed(_cpuinfo())
    return listed if listed is not None else _hardware_capabilities()


def arm_features_listed(cpuinfo: str) -> frozenset[str] | None:
    """ARM_FEATURES in a Linux cpuinfo's "Features" line, or None where it has none."""
    match = re.search(r"^Features\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    return frozenset(match.group(1).split()) & ARM_FEATURES.keys() if match else None


def _sysctl_flag(name: str) -> bool:
    found = subprocess.run(["sysctl", "-n", f"hw.optional.arm.{name}"], capture_output=True, text=True)
    return found.returncode == 0 and found.stdout.strip() == "1"


def _hardware_capabilities() -> frozenset[str]:
    getauxval = ctypes.CDLL(None).getauxval
    getauxval.argtypes, getauxval.restype = [ctypes.c_ulong], ctypes.c_ulong
    return frozenset(name for name, (_, word, bit) in ARM_FEATURES.items() if getauxval(word) & bit)


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux
        return ""
