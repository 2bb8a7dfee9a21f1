"""The exact CPU expert path: each expert's rows through its own FFN, experts run side by side.

Two choices make it fast on a CPU:
- Weights are packed once, when the layer is built, into the layout the matmul kernel reads in order.
  On x86-64 with AVX512-BF16, bf16 experts run the engine's own kernel (bf16_linear), which streams an
  expert's weights faster than oneDNN at the few dozen rows an expert sees; other x86 CPUs use oneDNN's
  packed layout (a plain weight is re-laid out by every call, up to twice as slow); elsewhere (Arm:
  Apple's Accelerate) plain `F.linear` is the fast path. Packed weights are a copy: the model keeps its own.
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
import torch.nn.functional as F
from transformers.activations import ACT2FN

from npumoe.engine import bf16_linear

Task = Callable[[], object]  # run for its effect; what it returns is dropped

# x86 vector extensions torch reports; elsewhere (Arm: Apple's Accelerate) plain F.linear is the fast path.
_X86 = ("AVX2", "AVX512")


def packs(dtype: torch.dtype) -> bool:
    """Whether this x86 CPU has oneDNN's packed-weight matmul for `dtype` (bf16 needs AVX512 or AMX)."""
    if not torch.backends.mkldnn.is_available() or torch.backends.cpu.get_cpu_capability() not in _X86:
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


KERNELS = ("npumoe-bf16", "onednn", "torch")


def bf16_kernel() -> tuple[str, str]:
    """The kernel bf16 experts run on this CPU (where their shapes allow the engine's), and why."""
    why = bf16_linear.unavailable()
    if why is None and torch.cpu._is_amx_tile_supported():
        # Not measured here (no AMX machine): oneDNN's tile matmuls peak far above AVX512-BF16 dot products.
        why = "this CPU has AMX tiles, which oneDNN's matmuls use"
    if why is None:
        return "npumoe-bf16", "the engine's AVX512-BF16 kernel"
    return ("onednn" if packs(torch.bfloat16) else "torch"), why


def kernel_for(*weights: torch.Tensor) -> str:
    """The fastest matmul kernel here for (…, N, K) weights of one dtype and device: one of KERNELS."""
    w = weights[0]
    if w.device.type != "cpu":
        return "torch"
    if w.dtype == torch.bfloat16 and all(bf16_linear.supports(*v.shape[-2:]) for v in weights):
        return bf16_kernel()[0]
    return "onednn" if packs(w.dtype) else "torch"


class PackedLinear:
    """y = x · wᵀ for one (N, K) weight, held in the layout `kernel` reads (a copy, except for plain torch)."""

    def __init__(self, w: torch.Tensor, kernel: str) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        self.kernel = kernel
        with torch.no_grad():
            if kernel == "npumoe-bf16":
                self.weight = bf16_linear.pack(w)
            elif kernel == "onednn":
                self.weight = torch.ops.mkldnn._reorder_linear_weight(w.contiguous())
            else:
                self.weight = w

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(n, K) -> (n, N), written into `out` when given."""
        if self.kernel == "npumoe-bf16":
            return bf16_linear.linear(x, self.weight, out)
        if self.kernel == "onednn":
            y = torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        else:
            y = F.linear(x, self.weight)
        return y if out is None else out.copy_(y)


class CpuExperts:
    """E gated expert FFNs on dynamic rows, weights in the layout this CPU's matmul kernel reads.

    gate_up: (E, 2I, H), the gate rows first; down: (E, H, I).
    """

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act: str) -> None:
        self.act = ACT2FN[act]
        self.kernel = kernel_for(gate_up, down)
        self.gate_up = [PackedLinear(w, self.kernel) for w in gate_up.detach()]
        self.down = [PackedLinear(w, self.kernel) for w in down.detach()]
        self._source = _identity(gate_up, down)

    def packed_from(self, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
        """Whether these are the very weights this was packed from, unchanged since."""
        return self._source == _identity(gate_up, down)

    def __len__(self) -> int:
        return len(self.gate_up)

    def __call__(self, expert: int, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(n, H) rows through expert `expert`: (n, 2I) -> (n, I) -> (n, H), written into `out` when given."""
        gate, up = self.gate_up[expert](x).chunk(2, dim=-1)
        return self.down[expert](self.act(gate).mul_(up), out)


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
