"""The matmul kernel the CPU experts run, chosen by timing the candidates on this machine.

Three kernels can run an expert's (N, K) weights: the engine's own bf16 kernel (bf16_linear: x86-64 with
AVX512-BF16, where it builds), oneDNN's packed matmul (x86 CPUs with AVX2 or AVX-512) and plain torch
(everywhere: on Arm it is Apple's Accelerate or OpenBLAS). Which of them is fastest depends on more than
the feature list: on a Zen 4 core the engine's kernel streams an expert's weights faster than oneDNN, on a
CPU with AMX tiles oneDNN's tile matmuls may win, and the torch build matters too. So the features only say
what can run (`unavailable_kernels`); the first layer of each dtype and expert shape on a machine times
those that can on its real weights for a few milliseconds and keeps the fastest (`choose_kernel`). The
choice and its figures are cached in the user cache with the CPU model and torch version they were
measured with, so later processes reuse them; `npumoed doctor` shows them.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.nn.functional as F

from . import bf16_linear
from .host import cache_root, cpu_model

KERNELS = ("npumoe-bf16", "onednn", "torch")

# x86 vector extensions torch reports, which oneDNN's packed matmuls need.
_X86 = ("AVX2", "AVX512")

# What a timing run sees: an expert's rows in a 512-token prefill chunk (top-8 of 128 experts: 32 on average),
# a few experts in turn so the weights come from memory rather than cache, as in a layer, and a few
# milliseconds a kernel, with a handful of samples at least.
ROWS = 32
_ROTATED_BYTES, MAX_ROTATED = 32 * 2**20, 8
_BUDGET_S = 0.005
_MIN_SAMPLES, _MAX_SAMPLES = 5, 200


def packs(dtype: torch.dtype) -> bool:
    """Whether this x86 CPU has oneDNN's packed-weight matmul for `dtype` (bf16 needs AVX-512 or AMX)."""
    if not torch.backends.mkldnn.is_available() or torch.backends.cpu.get_cpu_capability() not in _X86:
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def unavailable_kernels(*weights: torch.Tensor) -> dict[str, str]:
    """The kernels that cannot run these (…, N, K) weights of one dtype and device here, each with why;
    the others can (plain torch runs anything)."""
    w = weights[0]
    if w.device.type != "cpu":
        elsewhere = f"the weights are on {w.device.type}, not the CPU"
        return {"npumoe-bf16": elsewhere, "onednn": elsewhere}
    dtype = str(w.dtype).removeprefix("torch.")
    reasons = {}
    if w.dtype != torch.bfloat16:
        reasons["npumoe-bf16"] = f"it reads bf16 weights, not {dtype}"
    elif not all(bf16_linear.supports(*v.shape[-2:]) for v in weights):
        reasons["npumoe-bf16"] = f"it needs weights of whole blocks of {bf16_linear.BLOCK} rows and an even width"
    elif (why := bf16_linear.unavailable()) is not None:  # the shapes fit: only now is a build worth trying
        reasons["npumoe-bf16"] = why
    if not packs(w.dtype):
        reasons["onednn"] = f"this CPU or torch build has no oneDNN packed {dtype} matmul"
    return reasons


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


@dataclass(frozen=True)
class KernelChoice:
    kernel: str
    seconds: dict[str, float]  # median seconds of one expert on ROWS rows, per kernel timed; {} if one could run
    unavailable: dict[str, str]  # the kernels that cannot run here, and why

    def describe(self) -> str:
        if not self.seconds:
            return f"{self.kernel}, the only kernel that runs here ({_reasons(self.unavailable)})"
        cannot = f"; {_reasons(self.unavailable)}" if self.unavailable else ""
        return f"{self.kernel}, the fastest measured per expert of {ROWS} rows: {self.figures()}{cannot}"

    def figures(self) -> str:
        """Each kernel timed and its median, fastest first."""
        return ", ".join(f"{kernel} {seconds * 1e3:.3g} ms" for kernel, seconds in sorted(self.seconds.items(),
                                                                                          key=lambda i: i[1]))


def _reasons(unavailable: dict[str, str]) -> str:
    return "; ".join(f"{kernel} cannot: {why}" for kernel, why in unavailable.items())


def shape_class(dtype: torch.dtype, hidden: int, ffn: int) -> str:
    """The key a choice is kept under: the weights' dtype and an expert's sizes."""
    return f"{str(dtype).removeprefix('torch.')} hidden {hidden} ffn {ffn}"


_choices: dict[str, KernelChoice] = {}  # this process's choices, by shape class
_choices_lock = threading.Lock()


def choose_kernel(gate_up: torch.Tensor, down: torch.Tensor) -> KernelChoice:
    """The fastest kernel here for experts of these weights' dtype and shapes: timed on them at first use on
    this machine, then read from the cache."""
    unavailable = unavailable_kernels(gate_up, down)
    candidates = [kernel for kernel in KERNELS if kernel not in unavailable]
    if candidates == ["torch"] or len(gate_up) == 0:  # nothing to compare
        return KernelChoice("torch", {}, unavailable)
    key = shape_class(gate_up.dtype, *down.shape[-2:])  # down: (E, H, I)
    return choose_measured(key, candidates, unavailable, lambda: time_kernels(candidates, gate_up, down), _CACHE)


def choose_measured(key: str, candidates: Sequence[str], unavailable: dict[str, str],
                    timer: Callable[[], dict[str, float]], cache: ChoiceCache, *,
                    one_thread: bool = True) -> KernelChoice:
    """The fastest of `candidates` for the shape class `key`: this process's choice, else the cached one, else
    timed now by `timer` (median seconds per kernel, run on one torch thread as an expert's worker runs, or with
    every torch thread the caller has when not `one_thread`) and cached."""
    with _choices_lock:
        choice = _choices.get(key) or cache.get(key, unavailable)
        if choice is None or choice.seconds.keys() != set(candidates):  # new here, or what can run has changed
            seconds = _on_one_torch_thread(timer) if one_thread else _in_inference_mode(timer)
            choice = KernelChoice(min(seconds, key=seconds.__getitem__), seconds, unavailable)
            cache.remember(key, choice)
        _choices[key] = choice
    return choice


def choose_for_shape(hidden: int, ffn: int, dtype: torch.dtype) -> KernelChoice:
    """The choice for experts of these sizes, timed on random weights if this machine has none yet."""
    experts = _rotated(3 * hidden * ffn * dtype.itemsize)
    generator = torch.Generator().manual_seed(0)
    gate_up = torch.randn(experts, 2 * ffn, hidden, generator=generator, dtype=dtype)
    down = torch.randn(experts, hidden, ffn, generator=generator, dtype=dtype)
    return choose_kernel(gate_up, down)


def time_kernels(kernels: Sequence[str], gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, float]:
    """Median seconds of one expert's gate-up and down matmuls on ROWS rows, for each kernel, timed in turns
    (so the machine's drift moves all alike) over a few experts' real weights packed for each."""
    count = min(len(gate_up), _rotated((gate_up[0].numel() + down[0].numel()) * gate_up.element_size()))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, gate_up.shape[-1], generator=generator).to(gate_up.dtype)
    h = torch.randn(ROWS, down.shape[-1], generator=generator).to(down.dtype)
    packed = {kernel: [(PackedLinear(gate_up[e], kernel), PackedLinear(down[e], kernel)) for e in range(count)]
              for kernel in kernels}

    def run(kernel: str, expert: int) -> None:
        project_up, project_down = packed[kernel][expert]
        project_up(x)
        project_down(h)

    return time_in_turns(kernels, count, run)


def time_in_turns(kernels: Sequence[str], count: int, run: Callable[[str, int], None]) -> dict[str, float]:
    """Median seconds of `run(kernel, expert)` for each kernel, after every kernel has run every one of `count`
    experts once, timed in turns (so the machine's drift moves all alike) rotating over the experts."""
    for kernel in kernels:  # warm-up: every packed weight touched once
        for expert in range(count):
            run(kernel, expert)
    samples: dict[str, list[float]] = {kernel: [] for kernel in kernels}
    deadline = time.perf_counter() + _BUDGET_S * len(kernels)
    turn = 0
    while turn < _MIN_SAMPLES or (turn < _MAX_SAMPLES and time.perf_counter() < deadline):
        for kernel in kernels if turn % 2 else reversed(kernels):
            start = time.perf_counter()
            run(kernel, turn % count)
            samples[kernel].append(time.perf_counter() - start)
        turn += 1
    return {kernel: statistics.median(times) for kernel, times in samples.items()}


def _rotated(expert_bytes: int) -> int:
    """How many experts a timing run takes in turn: enough that, as in a layer, most reads miss the caches."""
    return max(1, min(MAX_ROTATED, _ROTATED_BYTES // expert_bytes))


T = TypeVar("T")


def _in_inference_mode(fn: Callable[[], T]) -> T:
    with torch.inference_mode():
        return fn()


def _on_one_torch_thread(fn: Callable[[], T]) -> T:
    """fn() with one torch thread, as the experts' workers run each expert, and in inference mode."""
    threads = torch.get_num_threads()
    if threads == 1:
        with torch.inference_mode():
            return fn()

    def single() -> T:
        torch.set_num_threads(1)
        with torch.inference_mode():
            return fn()

    with ThreadPoolExecutor(1, thread_name_prefix="npumoe-kernel-timing") as pool:
        result = pool.submit(single).result()
    torch.set_num_threads(threads)  # the thread's count is also the one new threads start with: put it back
    return result


class ChoiceCache:
    """The user-cache file where one family of kernels keeps this machine's choices, one file per machine: the
    CPU model, the torch version and the hash of the kernels' own `sources` (an edited kernel may be faster or
    slower than the one that was timed)."""

    def __init__(self, store: str, sources: Sequence[Path]) -> None:
        self.store = store
        self.sources = tuple(sources)

    def _file(self) -> tuple[Path, dict[str, str]]:
        """The file this machine's choices are kept in, and the machine they hold for."""
        digest = hashlib.sha256(b"".join(source.read_bytes() for source in self.sources)).hexdigest()[:16]
        machine = {"cpu": cpu_model(), "torch": torch.__version__, "kernel_source": digest}
        name = hashlib.sha256(json.dumps(machine, sort_keys=True).encode()).hexdigest()[:16]
        return cache_root() / self.store / f"{name}.json", machine

    def choices(self) -> dict[str, KernelChoice]:
        """Every choice this machine has cached, by shape class (without what cannot run: that is not cached)."""
        path, machine = self._file()
        try:
            held = json.loads(path.read_text())
            if {key: held[key] for key in machine} != machine:
                return {}
            choices = {key: KernelChoice(entry["kernel"], {k: float(s) for k, s in entry["seconds"].items()}, {})
                       for key, entry in held["choices"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):  # none yet, or not a file we wrote
            return {}
        return {key: choice for key, choice in choices.items() if choice.kernel in choice.seconds}

    def get(self, key: str, unavailable: dict[str, str]) -> KernelChoice | None:
        choice = self.choices().get(key)
        return None if choice is None else KernelChoice(choice.kernel, choice.seconds, unavailable)

    def remember(self, key: str, choice: KernelChoice) -> None:
        """Add a choice to this machine's cache file, replaced whole so no reader sees half of it."""
        path, machine = self._file()
        entries = {k: {"kernel": c.kernel, "seconds": c.seconds} for k, c in self.choices().items()}
        entries[key] = {"kernel": choice.kernel, "seconds": choice.seconds}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, partial = tempfile.mkstemp(dir=path.parent, prefix=".writing-", suffix=".json")
        except OSError:  # a read-only cache: this process keeps its choice, the next one times again
            return
        try:
            with os.fdopen(fd, "w") as file:
                json.dump({**machine, "choices": entries}, file, indent=1)
            os.replace(partial, path)
        except OSError:
            Path(partial).unlink(missing_ok=True)


_CACHE = ChoiceCache("cpu-kernels", (bf16_linear.SOURCE,))


def cached_choices() -> dict[str, KernelChoice]:
    """Every float-kernel choice this machine has cached, by shape class."""
    return _CACHE.choices()
