"""The exact CPU expert path: gated FFNs on packed weights, and whole experts shared out to worker threads."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support.cpus import APPLE_SILICON, CPUS, INTEL_MAC, fake_build, fake_timings, fresh_process, simulate

from npumoe.engine.kernels import float_kernels, host
from npumoe.engine.kernels.float_kernels import KERNELS, choose_kernel, unavailable_kernels
from npumoe.engine.kernels.host import cpu_model
from npumoe.engine.kernels.workers import run_tasks
from npumoe.engine.moe.cpu_experts import CpuExperts
from npumoe.engine.moe.experts_layout import ExpertsLayout, ExpertWeights

E, H, FFN = 4, 64, 32
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2}}


def random_experts(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(E, 2 * FFN, H, generator=g) / H**0.5).to(dtype), (torch.randn(E, H, FFN, generator=g)
                                                                           / FFN**0.5).to(dtype)


def gated_ffn(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: str) -> torch.Tensor:
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear((F.silu(gate) if act == "silu" else F.gelu(gate)) * up, down)


def forced(monkeypatch: pytest.MonkeyPatch, cache: Path, kernel: str, *weights: torch.Tensor) -> None:
    """Make `kernel` the measured choice for these weights, or skip where it cannot run on this machine."""
    why = unavailable_kernels(*weights).get(kernel)
    if why is not None:
        pytest.skip(f"{kernel} cannot run here: {why}")
    fake_timings(monkeypatch, cache, fastest=kernel)


@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize(("dtype", "kernel"), [(torch.float32, "onednn"), (torch.float32, "torch"),
                                               *((torch.bfloat16, kernel) for kernel in KERNELS)])
def test_each_expert_runs_its_own_gated_ffn_on_any_number_of_rows(monkeypatch, tmp_path, dtype, act, kernel):
    gate_up, down = random_experts(dtype)
    forced(monkeypatch, tmp_path, kernel, gate_up, down)
    experts = CpuExperts(ExpertWeights(gate_up, down), ExpertsLayout(activation=act))
    assert experts.kernel == kernel
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = torch.zeros(40, H, dtype=dtype)
    for e, rows in ((0, 1), (1, 5), (3, 37)):
        expected = gated_ffn(x[:rows], gate_up[e], down[e], act)
        torch.testing.assert_close(experts(e, x[:rows]), expected, **TOLERANCE[dtype])
        experts(e, x[:rows], out=out[2:2 + rows])  # straight into rows of a larger buffer
        torch.testing.assert_close(out[2:2 + rows], expected, **TOLERANCE[dtype])
    assert not out[:2].any() and not out[39:].any()


@pytest.mark.parametrize(("kernel", "layout"), [
    ("npumoe-bf16", lambda w: w.shape == (1, H // 2, 64, 2)),  # (2I/64, H/2, 64, 2)
    ("onednn", lambda w: w.is_mkldnn),
    ("torch", lambda w: w.shape == (2 * FFN, H) and not w.is_mkldnn),
])
def test_bf16_experts_hold_their_weights_in_the_layout_of_the_chosen_kernel(monkeypatch, tmp_path, kernel, layout):
    weights = random_experts(torch.bfloat16)
    forced(monkeypatch, tmp_path, kernel, *weights)
    experts = CpuExperts(ExpertWeights(*weights))
    assert experts.kernel == kernel and all(layout(w.weight) for w in experts.gate_up)


@pytest.mark.parametrize("cpu", CPUS, ids=lambda cpu: cpu.name)
def test_the_cpu_features_say_only_which_kernels_can_run(tmp_path, monkeypatch, cpu):
    simulate(monkeypatch, cpu)
    fake_build(monkeypatch, tmp_path)
    can_run = {str(dtype): [k for k in KERNELS if k not in unavailable_kernels(*random_experts(dtype))]
               for dtype in (torch.bfloat16, torch.float32)}
    engine_kernel = ["npumoe-bf16"] if cpu.avx512_bf16 else []  # with AMX or without: the timing decides
    onednn = ["onednn"] if cpu.onednn and cpu.capability in ("AVX2", "AVX512") else []
    assert can_run == {"torch.bfloat16": [*engine_kernel, *(onednn if cpu.onednn_bf16 else []), "torch"],
                       "torch.float32": [*onednn, "torch"]}
    gate_up, down = random_experts(torch.bfloat16)
    assert "whole blocks of 64" in unavailable_kernels(gate_up[:, :48], down[:, :, :24])["npumoe-bf16"]


@pytest.mark.parametrize("cpu", [APPLE_SILICON, INTEL_MAC], ids=lambda cpu: cpu.name)
def test_where_only_torch_can_run_nothing_is_timed(tmp_path, monkeypatch, cpu):
    simulate(monkeypatch, cpu)
    fake_build(monkeypatch, tmp_path)
    timings = fake_timings(monkeypatch, tmp_path, "torch")
    choice = choose_kernel(*random_experts(torch.bfloat16))
    assert (choice.winner, choice.seconds, timings.calls) == ("torch", {}, [])
    assert "the only candidate that runs here" in choice.describe() and "npumoe-bf16 cannot" in choice.describe()


@pytest.mark.parametrize("fastest", KERNELS)
def test_the_kernel_measured_fastest_is_chosen(tmp_path, monkeypatch, fastest):
    timings = fake_timings(monkeypatch, tmp_path, fastest)
    monkeypatch.setattr(float_kernels, "unavailable_kernels", lambda *weights: {})  # all three can run
    choice = choose_kernel(*random_experts(torch.bfloat16))
    assert timings.calls == [KERNELS]
    assert choice.winner == fastest == min(choice.seconds, key=choice.seconds.__getitem__)
    assert choice.seconds == timings.seconds
    assert choice.describe().startswith(f"{fastest} ({fastest} 1 ms, ")


def test_a_choice_is_cached_with_the_machine_and_reused_by_the_next_process(tmp_path, monkeypatch):
    timings = fake_timings(monkeypatch, tmp_path, "onednn")
    monkeypatch.setattr(float_kernels, "unavailable_kernels", lambda *weights: {})
    first = choose_kernel(*random_experts(torch.bfloat16))
    assert choose_kernel(*random_experts(torch.bfloat16)) == first  # this process remembers
    fresh_process(monkeypatch)
    assert choose_kernel(*random_experts(torch.bfloat16)) == first  # the next one reads the cache
    assert len(timings.calls) == 1
    cached, = (tmp_path / "choices").glob("*.json")  # every kind of choice in one file per machine
    held = json.loads(cached.read_text())
    assert (held["cpu"], held["torch"]) == (cpu_model(), torch.__version__)
    entry = held["choices"]["float kernels"][f"bfloat16 hidden {H} ffn {FFN} threads 1"]
    assert (entry["winner"], entry["seconds"]) == ("onednn", timings.seconds)
    # Another shape class, or another dtype, is a choice of its own.
    choose_kernel(*random_experts(torch.float32))
    gate_up, down = random_experts(torch.bfloat16)
    choose_kernel(gate_up[:, :, :32], down[:, :32])  # hidden 32
    assert len(timings.calls) == 3


@pytest.mark.parametrize("change", ["another CPU", "another torch", "a kernel that can run now"])
def test_a_cached_choice_is_timed_again_when_the_machine_or_what_can_run_changed(tmp_path, monkeypatch, change):
    timings = fake_timings(monkeypatch, tmp_path, "torch")
    monkeypatch.setattr(float_kernels, "unavailable_kernels", lambda *weights: {"npumoe-bf16": "no compiler"})
    choose_kernel(*random_experts(torch.bfloat16))
    fresh_process(monkeypatch)
    if change == "another CPU":
        monkeypatch.setattr(host, "cpu_model", lambda: "Another CPU")  # the machine fingerprint reads it
    elif change == "another torch":
        monkeypatch.setattr(torch, "__version__", "0.0.1")
    else:
        monkeypatch.setattr(float_kernels, "unavailable_kernels", lambda *weights: {})  # a compiler came
    choice = choose_kernel(*random_experts(torch.bfloat16))
    assert len(timings.calls) == 2 and choice.seconds.keys() == set(timings.calls[-1])


def test_kernels_are_timed_single_threaded_as_the_workers_run_them_and_the_caller_keeps_its_threads(
        tmp_path, monkeypatch, threads):
    fresh_process(monkeypatch, tmp_path)
    seen: list[int] = []
    real = float_kernels.time_kernels

    def timed(*args):
        seen.append(torch.get_num_threads())
        return real(*args)

    monkeypatch.setattr(float_kernels, "time_kernels", timed)
    weights = random_experts(torch.float32)
    if len(float_kernels.KERNELS) - len(unavailable_kernels(*weights)) < 2:
        pytest.skip("only torch's matmul runs here: nothing to time")
    choice = choose_kernel(*weights)
    assert seen == [1] and torch.get_num_threads() == threads
    assert choice.winner in choice.seconds and all(seconds > 0 for seconds in choice.seconds.values())


def test_experts_are_converted_and_packed_on_one_torch_thread_and_the_caller_keeps_its_threads(
        tmp_path, monkeypatch, threads):
    weights = random_experts(torch.float32)
    fake_timings(monkeypatch, tmp_path, fastest="torch")
    seen: list[int] = []

    def read() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:  # as a loader converts each expert when it is read
        for e in range(E):
            seen.append(torch.get_num_threads())
            yield weights[0][e], weights[1][e]

    experts = CpuExperts.streamed(read(), torch.float32, format="int8")
    assert len(experts) == E and seen == [1] * E and torch.get_num_threads() == threads


def test_tasks_run_once_each_on_worker_threads_of_one_torch_thread(threads):
    seen: list[tuple[int, str, int]] = []
    run_tasks([lambda i=i: seen.append((i, threading.current_thread().name, torch.get_num_threads()))
               for i in range(10)])
    assert sorted(i for i, _, _ in seen) == list(range(10))
    assert {(name.startswith("npumoe-experts"), count) for _, name, count in seen} == {(True, 1)}
    assert torch.get_num_threads() == threads  # the caller keeps its own


@pytest.mark.parametrize("threads", [3], indirect=True)
def test_a_thread_started_after_the_workers_starts_with_the_callers_thread_count(threads):
    run_tasks([lambda: None] * threads)  # a fresh pool: its workers set themselves to one thread
    counts: list[int] = []
    later = threading.Thread(target=lambda: counts.append(torch.get_num_threads()))
    later.start()
    later.join()
    assert counts == [threads]


def test_one_worker_takes_the_heaviest_tasks_first_and_the_other_the_lightest(threads):
    started = threading.Barrier(2, timeout=10)  # each worker's first task waits for the other's
    local = threading.local()
    taken: dict[str, list[int]] = {}

    def task(i: int) -> None:
        taken.setdefault(threading.current_thread().name, []).append(i)
        if not getattr(local, "waited", False):
            local.waited = True
            started.wait()

    run_tasks([lambda i=i: task(i) for i in range(10)])  # given heaviest first
    front, back = sorted(taken.values(), key=lambda ids: ids[0])
    assert front[0] == 0 and front == sorted(front)
    assert back[0] == 9 and back == sorted(back, reverse=True)
    assert sorted(front + back) == list(range(10))


def test_an_error_in_a_task_reaches_the_caller(threads):
    with pytest.raises(ZeroDivisionError):
        run_tasks([lambda: None, lambda: 1 / 0, lambda: None])


def test_tasks_run_in_the_callers_autograd_mode(threads):
    modes: list[tuple[bool, bool]] = []

    def record() -> None:
        modes.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))

    with torch.inference_mode():
        run_tasks([record, record])
    with torch.no_grad():
        run_tasks([record, record])
    assert modes == [(True, False)] * 2 + [(False, False)] * 2


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_runs_tasks_on_workers_of_its_own(threads):
    run_tasks([lambda: None] * threads)  # the parent's workers exist
    pid = os.fork()
    if pid == 0:  # the child: the parent's worker threads did not come along
        done: list[int] = []
        try:
            run_tasks([lambda i=i: done.append(i) for i in range(4)])
        finally:
            os._exit(0 if sorted(done) == [0, 1, 2, 3] else 1)
    deadline = time.monotonic() + 10
    while (waited := os.waitpid(pid, os.WNOHANG)) == (0, 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    if waited == (0, 0):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the child hung waiting for workers it does not have")
    assert os.waitstatus_to_exitcode(waited[1]) == 0
