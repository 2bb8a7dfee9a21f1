"""What a benchmark ran on: CPU, memory, torch build, the memory bandwidth measured here and now, OpenMP's wait
policy and the CPU governor, and how loaded the machine was while it ran.

Benchmark numbers mean little without the machine beside them, so every benchmark's JSON holds this.
"""

from __future__ import annotations

import os
import platform
import statistics
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import torch

from npumoe.engine.kernels import bf16_linear
from npumoe.engine.kernels.choice import median_seconds
from npumoe.engine.kernels.host import cpu_flags, cpu_model

# CPU features that decide how fast bf16 matmuls can run on x86 (AVX512-BF16 dot products, AMX tiles).
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile")

GOVERNOR = Path("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor")
LOAD_EVERY_S = 5.0  # how often the load average is sampled during a run

# Large enough to spill every cache level by far, small enough to allocate beside a benchmark's weights.
BANDWIDTH_BYTES = 512 * 2**20


def describe_machine(threads: int, *, bandwidth_bytes: int = BANDWIDTH_BYTES) -> dict:
    """The machine description a benchmark result is reported with (JSON-serialisable)."""
    return {
        "cpu": cpu_model(),
        "arch": platform.machine(),
        "os": platform.platform(),
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "threads": threads,
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn": torch.backends.mkldnn.is_available(),
        "mkldnn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "bf16_cpu_flags": [flag for flag in BF16_FLAGS if flag in cpu_flags()],
        "npumoe_bf16_kernel": bf16_linear.unavailable() or "available",
        "copy_bandwidth_gbps": round(copy_bandwidth(bandwidth_bytes) / 1e9, 2),
        # npumoed sets PASSIVE before torch loads (daemon/cli: wait_passively), unless the person set it
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY") or "unset (OpenMP's default)",
        "cpu_governor": governor(),
    }


def governor(path: Path = GOVERNOR) -> str | None:
    """The CPU frequency governor of the first core, where the OS lets it be read (None elsewhere)."""
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


@contextmanager
def sampled_load(machine: dict, *, every_s: float = LOAD_EVERY_S) -> Iterator[None]:
    """While the block runs, the 1-minute load average is sampled every `every_s` seconds; after it, `machine`
    holds `load_average` (before, after, the samples' median and highest) and `overloaded`: whether the load
    went above the machine's logical cores at any sample, when other work shared the cores with the run."""
    samples = [os.getloadavg()[0]]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(every_s):
            samples.append(os.getloadavg()[0])

    sampler = threading.Thread(target=sample, name="load-sampler", daemon=True)
    sampler.start()
    try:
        yield
    finally:
        stop.set()
        sampler.join()
        samples.append(os.getloadavg()[0])
        machine["load_average"] = {"before": samples[0], "after": samples[-1],
                                   "median": statistics.median(samples), "highest": max(samples),
                                   "samples": len(samples), "every_s": every_s}
        machine["overloaded"] = max(samples) > (os.cpu_count() or 1)


def load_warning(machine: dict) -> str | None:
    """The line a results table carries when its run was overloaded (sampled_load)."""
    if not machine.get("overloaded"):
        return None
    load = machine["load_average"]
    return (f"WARNING: load average reached {load['highest']:.1f} (median {load['median']:.1f}) on "
            f"{machine['logical_cores']} logical cores during this run: other work shared the cores, so its times "
            f"are noisy; trust the round-by-round ranges, not single figures")


def copy_bandwidth(nbytes: int = BANDWIDTH_BYTES, *, repeats: int = 5) -> float:
    """Bytes per second moved by a large tensor copy (each byte counted once read and once written)."""
    if nbytes < 2**20:
        raise ValueError(f"a bandwidth measurement needs at least 1 MiB to copy, got {nbytes} bytes")
    source = torch.ones(nbytes // 4, dtype=torch.float32)
    target = torch.empty_like(source)
    seconds = median_seconds(lambda: target.copy_(source), warmup=1, repeats=repeats)
    return 2 * source.numel() * source.element_size() / seconds
