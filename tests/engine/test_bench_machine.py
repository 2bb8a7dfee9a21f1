"""The machine description every benchmark result carries, and the timing every benchmark shares."""

from __future__ import annotations

import pytest
import torch

from npumoe.engine import bf16_linear
from npumoe.engine.machine import copy_bandwidth, describe_machine
from npumoe.engine.timing import median_seconds


def test_the_machine_description_names_cpu_memory_torch_build_and_measured_bandwidth():
    machine = describe_machine(threads=1, bandwidth_bytes=8 * 2**20)
    assert machine["threads"] == 1
    assert machine["cpu"] and machine["logical_cores"] >= 1 and machine["memory_gib"] > 0
    assert machine["torch"] == torch.__version__
    assert machine["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert isinstance(machine["mkldnn_bf16"], bool) and isinstance(machine["bf16_cpu_flags"], list)
    assert machine["npumoe_bf16_kernel"] == (bf16_linear.unavailable() or "available")
    assert machine["copy_bandwidth_gbps"] > 0


def test_a_bandwidth_measurement_needs_a_copy_larger_than_the_caches_can_pretend():
    with pytest.raises(ValueError, match="1 MiB"):
        copy_bandwidth(1024)


def test_the_median_is_of_the_timed_runs_after_the_warmup():
    calls = []
    median_seconds(lambda: calls.append(1), warmup=2, repeats=3)
    assert len(calls) == 5


def test_timing_needs_at_least_one_repeat():
    with pytest.raises(ValueError, match="repeats"):
        median_seconds(lambda: None, warmup=0, repeats=0)
