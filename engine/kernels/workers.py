"""The engine's worker threads: independent tasks (experts, row blocks) run side by side, one torch thread each."""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager

import torch

Task = Callable[[], object]  # run for its effect; what it returns is dropped


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


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """The block run with one torch thread, the caller's count put back after: for work made of many short
    element-wise ops over one expert's weight (converting, packing), which torch's intra-op threads slow down, each
    op waiting on all of them, far longer when another process holds a core (bench/results/gguf-load-*)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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
