"""One group graph on a device: a `GroupedExperts` module whose weights live there, run on fixed buffers.

A CUDA graph replays fixed shapes at fixed addresses, as a Neural Engine graph does: so the group's input and
output are static device buffers, and the host reaches them only through page-locked (pinned) staging buffers
of the same shape, which the device copies from and to without the host waiting. `enqueue` queues one run (copy
in, replay, copy out) on the current stream; `__call__` runs it and waits. With `capture` off the same module runs
eagerly on the same buffers (no graph): on a CPU that is how the class is checked against torch-static, and on a
GPU it is the baseline that launches every kernel one by one.
"""

from __future__ import annotations

import torch

from ...moe.grouped import GroupedExperts


class DeviceGroupGraph:
    """A (G, C, H) -> (G, C, H) group graph on `device`, captured as a CUDA graph when `capture` is on.

    Each graph keeps a memory pool of its own for its intermediates. Sharing one between a backend's graphs would
    save memory, but torch 2.11 asserts (CUDACachingAllocator use_count) when a graph is captured into a shared
    pool after every graph that used it was freed, as happens when the graphs timed for residency are let go."""

    def __init__(self, module: GroupedExperts, capacity: int, device: torch.device, *, capture: bool) -> None:
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs are captured on a CUDA device, not {device}: build it with capture off")
        self.device = device
        self.module = module.to(device)  # the group's weights, resident on the device
        shape = (module.group_size, capacity, module.hidden_size)
        dtype = module.down.dtype
        pinned = device.type == "cuda"
        with torch.inference_mode(False):  # normal tensors: written in and out of inference mode alike
            self.input = torch.zeros(shape, dtype=dtype, device=device)
            self.staged_in = torch.zeros(shape, dtype=dtype, pin_memory=pinned)
            self.staged_out = torch.zeros(shape, dtype=dtype, pin_memory=pinned)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: torch.Tensor | None = None
        if capture:
            self._capture()

    @property
    def capacity(self) -> int:
        return self.input.shape[1]

    @torch.no_grad()
    def _capture(self) -> None:
        # cuBLAS chooses its kernels and allocates its workspace on the first calls: those happen before the
        # capture, on a side stream, as torch's CUDA graph notes ask.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.module(self.input)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.output = self.module(self.input)

    @torch.no_grad()
    def enqueue(self, x: torch.Tensor) -> torch.Tensor:
        """Queue one run on `x` (G, C, H, on the host) on the current stream: x is copied into the pinned staging
        buffer now, the rest happens when the stream gets there. The result lands in the returned pinned buffer once
        the stream has passed this point; it is overwritten by the graph's next run."""
        self.staged_in.copy_(x)
        self.input.copy_(self.staged_in, non_blocking=True)
        if self.graph is not None:
            self.graph.replay()
            output = self.output
        else:
            output = self.module(self.input)
        self.staged_out.copy_(output, non_blocking=True)
        return self.staged_out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Run once on `x` and wait for the result (a plain group graph: checks and timings)."""
        y = self.enqueue(x)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return y.clone()
