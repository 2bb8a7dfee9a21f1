"""The prefill chunk length measured fastest for a loaded model on this machine (`chunk_tokens = 0`).

A chunk's cost per token has a part that shrinks as the chunk grows (each launch, the experts' weights read
once per chunk) and a part that grows with the depth it attends to; longer chunks amortise the first, and
at depth the second dominates whatever the length. So each candidate length is timed on random tokens twice:
from an empty cache (a section's start) and after `depth` tokens (where its last chunks run), and the one
with the least seconds per token over the two is kept: the mean cost over a section when that cost grows
about linearly with depth. The choice goes through the measured-choice mechanism (kernels/choice.py), keyed by
the model, its dtype, the lengths and depth and the threads, so it is measured once per machine; one round
each, as a real model's chunks take seconds.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

from ..kernels.choice import Choice, Measured, Rounds, time_in_turns
from .prefill import new_cache, prefill

log = logging.getLogger(__name__)

CANDIDATES = (256, 512, 1024, 2048)
MEASURED_DEPTH = 4096  # the deepest point timed: deeper would cost more to measure than it tells
CHOICES = Measured("chunk length", (Path(__file__),))
_ONE_ROUND = Rounds(least=1, most=1, budget_s=0.0, warmup=0)  # the warm-up is one chunk, not one per length


@dataclass(frozen=True)
class ChunkChoice:
    chunk_tokens: int
    depth: int
    choice: Choice  # seconds per token of each length, the mean of a chunk from empty and one after `depth`


@torch.inference_mode()
def time_chunk_lengths(model: PreTrainedModel, candidates: Sequence[int], depth: int, *,
                       seed: int = 0) -> dict[str, float]:
    """Seconds per token of each candidate length (by its decimal name): the mean of one chunk from an empty cache
    and one after `depth` tokens."""
    if not candidates or min(candidates) < 1 or depth < 1:
        raise ValueError(f"candidate lengths and the depth must be positive, got {candidates} and {depth}")
    vocab = model.config.get_text_config(decoder=True).vocab_size
    generator = torch.Generator().manual_seed(seed)
    longest = max(candidates)
    ids = torch.randint(vocab, (depth + longest,), generator=generator).tolist()
    deep = new_cache(model)
    for _ in prefill(model, ids[:depth], longest, deep):  # the deep cache, shared by every candidate's copy
        pass
    caches = []

    def fresh_caches(*_: object) -> None:  # untimed: copying the deep cache is no part of a chunk's cost
        caches[:] = [new_cache(model), copy.deepcopy(deep)]

    def run(length: str, _: int) -> None:
        n = int(length)
        next(prefill(model, ids[:n], n, caches[0]))
        next(prefill(model, ids[depth:depth + n], n, caches[1]))

    fresh_caches()
    run(str(min(candidates)), 0)  # first-call costs (kernel choice, allocations) out of the timings
    names = [str(length) for length in candidates]
    seconds = time_in_turns(names, 1, run, rounds=_ONE_ROUND, prepare=fresh_caches)
    return {name: s / (2 * int(name)) for name, s in seconds.items()}


def measured_chunk_tokens(model: PreTrainedModel, model_key: str, *, section_tokens: int, threads: int,
                          candidates: Sequence[int] = CANDIDATES) -> ChunkChoice:
    """The fastest candidate no longer than a section, measured at the start and at the depth a section reaches
    (at most MEASURED_DEPTH) on `threads` torch threads, or as measured before on this machine."""
    fitting = [length for length in candidates if length <= section_tokens] or [section_tokens]
    depth = max(1, min(section_tokens, MEASURED_DEPTH) - max(fitting))
    shape = {"model": model_key, "lengths": ",".join(map(str, fitting)), "depth": depth}
    # no accuracy probe: a chunk's length changes only the order the same kernels sum in
    choice = CHOICES.choose(model.dtype, shape, [str(length) for length in fitting],
                            lambda _: time_chunk_lengths(model, fitting, depth), threads=threads)
    log.info("chunk length: %s tokens (%s)", choice.winner, ", ".join(
        f"{length}: {1 / s:,.0f} tok/s" for length, s in choice.seconds.items()))
    return ChunkChoice(int(choice.winner), depth, choice)
