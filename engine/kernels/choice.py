"""The engine's one mechanism for a choice made by measuring on this machine: the key, the statistic, the record
and the cache every measured choice goes through (the float and quantized expert kernels, the projections'
kernels, the attention kernel, `auto` weights and the prefill chunk length).

- The key: the choice's dtype, its sizes and the torch thread count its candidates were timed with (a kernel
  fastest on one thread need not be on sixteen), built by `Measured.key` and nowhere else.
- The statistic: `time_in_turns`, the median of each candidate's seconds over rounds that interleave the
  candidates (so the machine's drift moves all alike), after a warm-up; one that the warm-up finds WARM_LAGGARD
  times slower than the fastest, or the first round LAGGARD times, keeps that figure and is not timed again
  (narrowed to AVX2 with AVX-VNNI, oneDNN's dynamic int8 took 37 s a run of a projection where the others took 15
  to 45 ms, and torch's weight-only int8 1.5 s: their runs were most of a first load's choices).
- Accuracy before speed: a choice with an accuracy notion passes a probe, each candidate's relative error on it
  against the reference computed here (`Accuracy`); a candidate above its format's bound is refused with its
  figures and not timed, so a fast wrong kernel is never chosen.
- The record: `Choice`, the winner, every candidate's figure, the candidates that cannot run here with why, and
  those the probe refused with why.
- The cache: one JSON file per machine (CPU model and feature flags, instruction-set ceilings, torch version) in the
  user cache, every kind of choice in it;
  each entry keeps the digest of the sources it was measured with (this module's among them), so an edited kernel
  is probed and timed again.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch

from .host import cache_root, machine_fingerprint

T = TypeVar("T")
LAGGARD = 5.0  # how many times the fastest's first figure takes a candidate out of the rounds that follow
WARM_LAGGARD = 20.0  # the same for the warm-up's, whose runs may build what they time (a packed weight)


@dataclass(frozen=True)
class Rounds:
    """How long the statistic times: at least `least` rounds, then more while `budget_s` per candidate lasts, at
    most `most`; `warmup` untimed rounds first."""

    least: int = 5
    most: int = 200
    budget_s: float = 0.005
    warmup: int = 1


@dataclass(frozen=True)
class Accuracy:
    """A candidate's relative error on a probe against the reference computed on this machine, and the bound its
    format allows (formats.quantize.error_bound)."""

    error: float
    bound: float

    def refusal(self) -> str | None:
        """Why the candidate is refused, or None when it is within its bound (an error that is not a number is
        not)."""
        if self.error <= self.bound:
            return None
        return f"relative error {self.error:.3g} against the reference, above its bound {self.bound:.3g}"


@dataclass(frozen=True)
class Choice:
    """A measured choice: `winner`, the figure of every candidate timed (median seconds per the kind's unit; {}
    when only one could run), the candidates that cannot run here and those refused, each with why."""

    winner: str
    seconds: dict[str, float]
    unavailable: dict[str, str] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)

    def figures(self) -> str:
        """Each candidate timed and its median, fastest first."""
        return ", ".join(f"{name} {s * 1e3:.3g} ms" for name, s in sorted(self.seconds.items(), key=lambda i: i[1]))

    def describe(self) -> str:
        """The winner, the figures that made it and what could not take part."""
        others = "; ".join([*(f"{name} cannot: {why}" for name, why in self.unavailable.items()),
                            *(f"{name} refused: {why}" for name, why in self.refused.items())])
        if not self.seconds:
            return f"{self.winner}, the only candidate that runs here" + (f" ({others})" if others else "")
        return f"{self.winner} ({self.figures()}" + (f"; {others})" if others else ")")


def time_in_turns(candidates: Sequence[str], count: int, run: Callable[[str, int], object], *,
                  rounds: Rounds = Rounds(), prepare: Callable[[str, int], object] | None = None) -> dict[str, float]:
    """Median seconds of `run(candidate, item)` for each candidate: `rounds.warmup` untimed runs of every candidate
    on each of `count` items, then rounds in which every candidate runs once, in alternating order, rotating over
    the items (only those within WARM_LAGGARD times the fastest on the warm-up's first item, and after the first
    round within LAGGARD times; one left out keeps that figure); `prepare(candidate, item)`, when given, runs
    untimed before each timed run."""
    warm: dict[str, float] = {}  # each candidate's first warm-up run
    timed = list(candidates)
    for _ in range(rounds.warmup):
        for item in range(count):
            for candidate in timed:
                start = time.perf_counter()
                run(candidate, item)
                warm.setdefault(candidate, time.perf_counter() - start)
            fastest = min(warm.values())  # after the first item, a hopeless candidate warms up no further
            timed = [candidate for candidate in timed if warm[candidate] <= WARM_LAGGARD * fastest]
    samples: dict[str, list[float]] = {candidate: [] if candidate in timed else [warm[candidate]]
                                       for candidate in candidates}
    deadline = time.perf_counter() + rounds.budget_s * len(candidates)
    turn = 0
    while turn < rounds.least or (turn < rounds.most and time.perf_counter() < deadline):
        for candidate in timed if turn % 2 else reversed(timed):
            if prepare is not None:
                prepare(candidate, turn % count)
            start = time.perf_counter()
            run(candidate, turn % count)
            samples[candidate].append(time.perf_counter() - start)
        if turn == 0:
            fastest = min(samples[candidate][0] for candidate in timed)
            timed = [candidate for candidate in timed if samples[candidate][0] <= LAGGARD * fastest]
        turn += 1
    return {candidate: statistics.median(times) for candidate, times in samples.items()}


def median_seconds(fn: Callable[[], object], *, warmup: int = 2, repeats: int = 5) -> float:
    """Median wall seconds of `fn()` over `repeats` runs after `warmup` untimed ones: the statistic on one
    candidate (the median: one slow outlier on a shared machine should not move it, the minimum flatters)."""
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    return time_in_turns(["fn"], 1, lambda *_: fn(), rounds=Rounds(repeats, repeats, 0.0, warmup))["fn"]


_KINDS: dict[str, Measured] = {}  # every kind of choice, by name, as its module made it: what doctor lists
_chosen: dict[tuple[Path, str, str], Choice] = {}  # this process's choices, by user cache, kind and key
# One lock per choice, so two threads do not time the same one at once while a choice that times another (auto
# weights times the float kernels) does not wait on itself.
_locks: defaultdict[tuple[str, str], threading.Lock] = defaultdict(threading.Lock)
_locks_lock = threading.Lock()


class Measured:
    """One kind of measured choice (`kind`, e.g. "float kernels"), whose candidates are code in `sources`."""

    def __init__(self, kind: str, sources: Sequence[Path]) -> None:
        self.kind, self.sources = kind, tuple(sources)
        _KINDS[kind] = self

    @staticmethod
    def key(dtype: torch.dtype | None, shape: Mapping[str, object], threads: int) -> str:
        """The key a choice is kept under: its dtype (if it has one), its sizes and the threads it was timed on."""
        parts = [str(dtype).removeprefix("torch.")] if dtype is not None else []
        return " ".join([*parts, *(f"{name} {size}" for name, size in shape.items()), f"threads {threads}"])

    def choose(self, dtype: torch.dtype | None, shape: Mapping[str, object], candidates: Sequence[str],
               timer: Callable[[Sequence[str]], dict[str, float]], *, threads: int,
               unavailable: Mapping[str, str] | None = None,
               probe: Callable[[Sequence[str]], Mapping[str, Accuracy]] | None = None) -> Choice:
        """The fastest of `candidates` within its bound: this process's choice, else the cached one, else measured
        now on `threads` torch threads in inference mode, and cached: `probe` (each candidate's accuracy; none for
        a choice whose candidates compute the same thing) refuses those above their bound, then `timer` gives the
        others' figures (from `time_in_turns`)."""
        key = self.key(dtype, shape, threads)
        held = (cache_root(), self.kind, key)  # a process that points at another cache has chosen nothing there
        choice = _chosen.get(held)
        if choice is not None and choice.seconds.keys() | choice.refused.keys() == set(candidates):
            return choice  # the common case, asked on every call of a kernel: no lock, no file
        unavailable = dict(unavailable or {})
        with _locks_lock:
            lock = _locks[(self.kind, key)]
        with lock:
            choice = _chosen.get(held) or self.cached().get(key)
            if choice is None or choice.seconds.keys() | choice.refused.keys() != set(candidates):
                choice = on_threads(threads, lambda: _measure(candidates, unavailable, timer, probe))  # new, or changed
                _store(self.kind, key, self._digest(), choice)
            choice = Choice(choice.winner, choice.seconds, unavailable, choice.refused)
            _chosen[held] = choice
        return choice

    def cached(self) -> dict[str, Choice]:
        """Every choice of this kind this machine has cached, by key."""
        digest = self._digest()
        return {key: choice for key, (sources, choice) in _read().get(self.kind, {}).items() if sources == digest}

    def _digest(self) -> str:
        sources = (Path(__file__), *self.sources)  # this module too: how a choice is made is part of it
        return hashlib.sha256(b"".join(source.read_bytes() for source in sources)).hexdigest()[:16]


def _measure(candidates: Sequence[str], unavailable: dict[str, str], timer: Callable[[Sequence[str]], dict[str, float]],
             probe: Callable[[Sequence[str]], Mapping[str, Accuracy]] | None) -> Choice:
    """The choice among `candidates` (beside those `unavailable`): those `probe` refuses, then the fastest of the
    rest by `timer`."""
    accuracy = probe(candidates) if probe is not None else {}
    refused = {name: why for name in candidates if name in accuracy and (why := accuracy[name].refusal())}
    accepted = [name for name in candidates if name not in refused]
    if not accepted:  # the reference is a candidate wherever there is a probe: this is a broken probe or machine
        raise RuntimeError("every candidate is refused: " + "; ".join(f"{n}: {why}" for n, why in refused.items()))
    seconds = timer(accepted)
    return Choice(min(seconds, key=seconds.__getitem__), seconds, unavailable, refused)


def cached_choices() -> dict[str, dict[str, Choice]]:
    """Every kind of choice made known (by importing its module) and its cached choices, by key."""
    return {kind: measured.cached() for kind, measured in _KINDS.items()}


def on_threads(threads: int, fn: Callable[[], T]) -> T:
    """fn() in inference mode with `threads` torch threads (on a thread of its own when that is not the caller's
    count, which is put back: it is also the count new threads start with)."""
    before = torch.get_num_threads()
    if threads == before:
        with torch.inference_mode():
            return fn()

    def run() -> T:
        torch.set_num_threads(threads)
        with torch.inference_mode():
            return fn()

    with ThreadPoolExecutor(1, thread_name_prefix="npumoe-choice-timing") as pool:
        result = pool.submit(run).result()
    torch.set_num_threads(before)
    return result


def _machine() -> dict[str, str]:
    return {**machine_fingerprint(), "torch": torch.__version__}


def _path() -> Path:
    name = hashlib.sha256(json.dumps(_machine(), sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "choices" / f"{name}.json"


def _read() -> dict[str, dict[str, tuple[str, Choice]]]:
    """This machine's cached choices: by kind, by key, (sources digest, choice)."""
    try:
        held = json.loads(_path().read_text())
        if {key: held[key] for key in _machine()} != _machine():
            return {}
        return {kind: {key: (entry["sources"], Choice(entry["winner"], {k: float(s) for k, s in
                                                                        entry["seconds"].items()},
                                                      dict(entry["unavailable"]), dict(entry["refused"])))
                       for key, entry in entries.items() if entry["winner"] in entry["seconds"]}
                for kind, entries in held["choices"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # none yet, or not a file we wrote
        return {}


def _store(kind: str, key: str, sources: str, choice: Choice) -> None:
    """Add a choice to this machine's file, replaced whole so no reader sees half of it."""
    entries = {k: {key: {"sources": s, **_entry(c)} for key, (s, c) in held.items()} for k, held in _read().items()}
    entries.setdefault(kind, {})[key] = {"sources": sources, **_entry(choice)}
    path = _path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=path.parent, prefix=".writing-", suffix=".json")
    except OSError:  # a read-only cache: this process keeps its choice, the next one times again
        return
    try:
        with os.fdopen(fd, "w") as file:
            json.dump({**_machine(), "choices": entries}, file, indent=1)
        os.replace(partial, path)
    except OSError:
        Path(partial).unlink(missing_ok=True)


def _entry(choice: Choice) -> dict[str, object]:
    return {"winner": choice.winner, "seconds": choice.seconds, "unavailable": choice.unavailable,
            "refused": choice.refused}
