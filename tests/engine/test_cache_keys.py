"""Measured costs and choices are kept per machine, and a machine is what changes the figures: not only the CPU's
name (a VM's is often generic) but its feature flags and the instruction-set ceilings; costs also per dtype, weights
format and threads."""

from __future__ import annotations

import pytest
import torch

from npumoe.engine import load_model
from npumoe.engine.backends.base import TorchStaticBackend
from npumoe.engine.backends.placement import place
from npumoe.engine.calibration.planner import calibrate_plan
from npumoe.engine.kernels import choice, host
from npumoe.engine.kernels.choice import Choice, Measured
from npumoe.engine.plan.cost_cache import CostCache

GENERIC = "Intel(R) Xeon(R) Processor"


@pytest.fixture
def generic_vm(monkeypatch):
    """A VM whose CPU name says nothing; `flags(...)` sets the flags it reports."""
    monkeypatch.setattr(host, "cpu_model", lambda: GENERIC)

    def flags(*names: str) -> None:
        monkeypatch.setattr(host, "cpu_flags", lambda: frozenset(names))

    flags("avx2", "fma")
    return flags


def test_a_measured_choice_is_not_reused_under_other_cpu_flags_or_an_isa_ceiling(generic_vm, monkeypatch, tmp_path):
    monkeypatch.setattr(choice, "_KINDS", dict(choice._KINDS))  # the kind made here is this test's alone
    kind = Measured("test-cache-keys", [])
    key = Measured.key(torch.float32, {"rows": 8}, threads=1)
    choice._store(kind.kind, key, kind._digest(), Choice("a", {"a": 1.0, "b": 2.0}))
    assert kind.cached() == {key: Choice("a", {"a": 1.0, "b": 2.0})}
    generic_vm("avx2", "fma", "avx512f")  # the same name, another processor underneath
    assert kind.cached() == {}
    generic_vm("avx2", "fma")
    monkeypatch.setenv(host.MAX_ISA_VARIABLE, "avx2")
    assert kind.cached() == {}
    monkeypatch.delenv(host.MAX_ISA_VARIABLE)
    assert key in kind.cached()  # back on the first machine: its choice is there


class CountingBackend(TorchStaticBackend):
    measured = 0

    def measure_costs(self, *args, **kwargs):
        CountingBackend.measured += 1
        return super().measure_costs(*args, **kwargs)


def test_costs_are_measured_again_under_other_cpu_flags_threads_or_weights(generic_vm, tiny, harbour, tmp_path):
    folder = tiny("qwen3_moe")
    plan = calibrate_plan(folder, [("harbour", harbour)], tmp_path / "plan.json", chunk_tokens=128)
    model = load_model(folder).model
    cache = CostCache(tmp_path / "costs")
    CountingBackend.measured = 0

    def placed(weights: str | None = None) -> int:
        place(plan, CountingBackend(), model, cache, weights=weights)
        return CountingBackend.measured

    assert placed() == 1 and placed() == 1  # measured once, then read
    generic_vm("avx2", "fma", "avx512f")
    assert placed() == 2  # another processor under the same name
    assert placed("int8") == 3  # the experts run quantized
    before = torch.get_num_threads()
    torch.set_num_threads(before + 1)
    try:
        assert placed("int8") == 4  # on more threads
    finally:
        torch.set_num_threads(before)
    assert placed("int8") == 5  # the file keeps the last measured; the threads changed back
    assert len(list((tmp_path / "costs").iterdir())) == 2  # one file per machine
