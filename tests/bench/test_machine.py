"""The machine description every benchmark result carries, and the timing every benchmark shares."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch

from npumoe.bench import timing
from npumoe.bench.machine import copy_bandwidth, describe_machine
from npumoe.bench.timing import interleaved_median_seconds, interleaved_seconds
from npumoe.engine.kernels import bf16_linear
from npumoe.engine.kernels.choice import median_seconds


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


def test_interleaved_timing_runs_every_function_once_a_round_in_a_rotating_order():
    calls: list[str] = []
    times = interleaved_median_seconds({name: lambda name=name: calls.append(name) for name in "abc"},
                                       warmup=1, repeats=2)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert set(times) == {"a", "b", "c"} and all(isinstance(t, float) and t >= 0 for t in times.values())


def test_interleaved_seconds_gives_each_functions_time_in_every_timed_round_in_order(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    durations = {"a": iter([9.0, 1.0, 2.0]), "b": iter([9.0, 3.0, 4.0])}  # a warm-up round, then two timed ones

    def run(name: str) -> None:
        now[0] += next(durations[name])

    rounds = interleaved_seconds({name: partial(run, name) for name in "ab"}, warmup=1, repeats=2)
    assert rounds == {"a": [1.0, 2.0], "b": [3.0, 4.0]}


def test_a_function_that_raises_leaves_the_rounds_and_its_error_is_returned_for_it():
    calls: list[str] = []

    def broken() -> None:
        calls.append("broken")
        raise RuntimeError("no kernel")

    times = interleaved_median_seconds({"ok": lambda: calls.append("ok"), "broken": broken}, warmup=0, repeats=3)
    assert calls.count("broken") == 1 and calls.count("ok") == 3
    assert isinstance(times["broken"], RuntimeError) and isinstance(times["ok"], float)
