"""The exact CPU expert path: gated FFNs on packed weights, and whole experts shared out to worker threads."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from npumoe.engine import bf16_linear
from npumoe.engine.cpu_experts import CpuExperts, bf16_kernel, packs, run_tasks

E, H, FFN = 4, 64, 32
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2}}


@pytest.fixture
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """torch threads for one test (the suite runs with one); parametrize indirectly to choose how many."""
    count = getattr(request, "param", 2)
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    yield count
    torch.set_num_threads(before)


def random_experts(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(E, 2 * FFN, H, generator=g) / H**0.5).to(dtype), (torch.randn(E, H, FFN, generator=g)
                                                                           / FFN**0.5).to(dtype)


def gated_ffn(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: str) -> torch.Tensor:
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear((F.silu(gate) if act == "silu" else F.gelu(gate)) * up, down)


@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_expert_runs_its_own_gated_ffn_on_any_number_of_rows(dtype, act):
    gate_up, down = random_experts(dtype)
    experts = CpuExperts(gate_up, down, act)
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = torch.zeros(40, H, dtype=dtype)
    for e, rows in ((0, 1), (1, 5), (3, 37)):
        expected = gated_ffn(x[:rows], gate_up[e], down[e], act)
        torch.testing.assert_close(experts(e, x[:rows]), expected, **TOLERANCE[dtype])
        experts(e, x[:rows], out=out[2:2 + rows])  # straight into rows of a larger buffer
        torch.testing.assert_close(out[2:2 + rows], expected, **TOLERANCE[dtype])
    assert not out[:2].any() and not out[39:].any()


@pytest.mark.skipif(bf16_linear.unavailable() is not None, reason=f"no bf16 kernel: {bf16_linear.unavailable()}")
def test_bf16_experts_run_the_engines_kernel_where_it_builds_and_the_cpu_has_avx512_bf16():
    experts = CpuExperts(*random_experts(torch.bfloat16), "silu")
    assert experts.kernel == "npumoe-bf16"
    assert all(w.weight.shape == (1, H // 2, 64, 2) for w in experts.gate_up)  # (2I/64, H/2, 64, 2)


@pytest.mark.skipif(not packs(torch.bfloat16), reason="this CPU has no oneDNN bf16 matmul")
def test_on_a_cpu_with_amx_tiles_bf16_experts_leave_the_matmuls_to_onednn(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert bf16_kernel() == ("onednn", "this CPU has AMX tiles, which oneDNN's matmuls use")
    assert CpuExperts(*random_experts(torch.bfloat16), "silu").kernel == "onednn"


@pytest.mark.skipif(not packs(torch.bfloat16), reason="this CPU has no oneDNN bf16 matmul")
def test_bf16_weights_the_kernel_cannot_take_are_held_in_onednn_layout():
    gate_up, down = random_experts(torch.bfloat16)
    experts = CpuExperts(gate_up[:, :48], down[:, :, :24], "silu")  # 2I = 48: not whole blocks of 64 columns
    assert experts.kernel == "onednn"
    assert all(w.weight.is_mkldnn for w in experts.gate_up + experts.down)


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
