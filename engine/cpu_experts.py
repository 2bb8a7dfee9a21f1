"""The exact CPU expert path: each expert's rows through its own FFN, experts run side by side.

An expert's FFN is the one its module's `ExpertsLayout` describes (experts_layout.py): the input projection,
its bias, the layout's gate or activation, the down projection and its bias.

Two choices make it fast on a CPU:
- Weights are packed once, when the layer is built, into the layout the matmul kernel reads in order: the
  kernel measured fastest on this machine for the experts' dtype and shapes (cpu_kernels: the engine's own
  bf16 kernel, oneDNN's packed matmul, or plain torch, as this CPU allows). Packed weights are a copy: the
  model keeps its own.
- Cores split the experts, not each matmul: every worker thread runs whole experts single-threaded.
  One worker takes the heaviest expert left, the next the lightest, so compute-bound heavy experts
  run beside memory-bound light ones; and a layer waits for its workers once instead of once per
  matmul, which matters when another process holds a core.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from .cpu_kernels import PackedLinear, choose_kernel
from .experts_layout import DEFAULT_LAYOUT, ExpertsLayout, ExpertWeights

Task = Callable[[], object]  # run for its effect; what it returns is dropped


class CpuExperts:
    """E expert FFNs of one layout on dynamic rows, weights in the layout of the matmul kernel fastest here."""

    def __init__(self, weights: ExpertWeights, layout: ExpertsLayout = DEFAULT_LAYOUT) -> None:
        self.layout = layout
        self.kernel = choose_kernel(weights.gate_up, weights.down).kernel
        self.gate_up = [PackedLinear(w, self.kernel) for w in weights.gate_up]
        self.down = [PackedLinear(w, self.kernel) for w in weights.down]
        self.gate_up_bias, self.down_bias = weights.gate_up_bias, weights.down_bias
        self._source = _identity(*weights.source)

    def packed_from(self, weights: ExpertWeights) -> bool:
        """Whether these are the very weights this was packed from, unchanged since."""
        return self._source == _identity(*weights.source)

    def __len__(self) -> int:
        return len(self.gate_up)

    def __call__(self, expert: int, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(n, H) rows through expert `expert`: (n, n·I) -> (n, I) -> (n, H), written into `out` when given."""
        h = self.gate_up[expert](x)
        if self.gate_up_bias is not None:
            h += self.gate_up_bias[expert]
        y = self.down[expert](self.layout.apply(h), out)
        if self.down_bias is not None:
            y += self.down_bias[expert]
        return y


def _identity(*weights: torch.Tensor) -> tuple:
    """Where each weight lives and how often it has been written to in place (torch counts that, except for
    tensors made in inference mode, which can be written only inside it)."""
    return tuple((w.data_ptr(), w.shape, w.stride(), w.dtype, 0 if w.is_inference() else w._version)
                 for w in weights)


class Workers:
    """`threads` worker threads, each running its tasks with one torch thread."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="npumoe-experts", initializer=_one_torch_thread)
        # torch keeps the thread count a new thread starts with in one global, which the initializer set to 1:
        # start every worker now (the barrier holds each task until all run), then put the global back.
        started = threading.Barrier(threads)
        wait([self._pool.submit(started.wait) for _ in range(threads)])
        torch.set_num_threads(threads)

    def run(self, tasks: Sequence[Task]) -> None:
        """Run `tasks`, given heaviest first: even workers take from the front, odd ones from the back."""
        queue = deque(tasks)
        # Autograd modes are per thread: the workers take the caller's (inference tensors refuse in-place
        # updates outside inference mode).
        inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

        def work(take: Callable[[], Task]) -> None:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                while True:
                    try:
                        task = take()
                    except IndexError:  # the queue is empty
                        return
                    task()

        futures = [self._pool.submit(work, queue.pop if i % 2 else queue.popleft) for i in range(self.threads)]
        for future in futures:
            future.result()  # re-raises a task's error

    def close(self) -> None:
        self._pool.shutdown()


def _one_torch_thread() -> None:
    torch.set_num_threads(1)
    torch.get_num_threads()  # fixes this thread's count now, before the global is put back


_workers: Workers | None = None
_workers_lock = threading.Lock()


def run_tasks(tasks: Sequence[Task]) -> None:
    """Run independent tasks, given heaviest first, on as many workers as torch has threads here."""
    if min(torch.get_num_threads(), len(tasks)) <= 1:  # a lone task keeps every thread for itself
        for task in tasks:
            task()
        return
    global _workers
    with _workers_lock:
        if _workers is None or _workers.threads != torch.get_num_threads():
            if _workers is not None:
                _workers.close()
            _workers = Workers(torch.get_num_threads())
        workers = _workers
    workers.run(tasks)


def _forget_workers() -> None:
    global _workers
    _workers = None  # a forked child has none of its parent's threads


os.register_at_fork(after_in_child=_forget_workers)
