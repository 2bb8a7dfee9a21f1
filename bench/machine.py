"""What a benchmark ran on: CPU, memory, torch build, and the memory bandwidth measured here and now.

Benchmark numbers mean little without the machine beside them, so every benchmark's JSON holds this.
"""

from __future__ import annotations

import os
import platform

import psutil
import torch

from npumoe.engine.kernels import bf16_linear
from npumoe.engine.kernels.choice import median_seconds
from npumoe.engine.kernels.host import cpu_flags, cpu_model

# CPU features that decide how fast bf16 matmuls can run on x86 (AVX512-BF16 dot products, AMX tiles).
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile")

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
    }


def copy_bandwidth(nbytes: int = BANDWIDTH_BYTES, *, repeats: int = 5) -> float:
    """Bytes per second moved by a large tensor copy (each byte counted once read and once written)."""
    if nbytes < 2**20:
        raise ValueError(f"a bandwidth measurement needs at least 1 MiB to copy, got {nbytes} bytes")
    source = torch.ones(nbytes // 4, dtype=torch.float32)
    target = torch.empty_like(source)
    seconds = median_seconds(lambda: target.copy_(source), warmup=1, repeats=repeats)
    return 2 * source.numel() * source.element_size() / seconds
