"""The prefill chunk length measured fastest for a loaded model on this machine (`chunk_tokens = 0`).

A chunk's cost per token has a part that shrinks as the chunk grows (each launch, the experts' weights read
once per chunk) and a part that grows with the depth it attends to; longer chunks amortise the first, and
at depth the second dominates whatever the length. So each candidate length is timed on random tokens twice:
from an empty cache (a section's start) and after `depth` tokens (where its last chunks run), and the one
with the least seconds per token over the two is kept: the mean cost over a section when that cost grows
about linearly with depth. The result is cached per machine, model, weights and threads, so it is measured
once.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

from ..plan.cost_cache import machine_digest, write_json
from .prefill import new_cache, prefill

log = logging.getLogger(__name__)

CANDIDATES = (256, 512, 1024, 2048)
MEASURED_DEPTH = 4096  # the deepest point timed: deeper would cost more to measure than it tells


@dataclass(frozen=True)
class ChunkTiming:
    chunk_tokens: int
    start_s_per_token: float  # from an empty cache
    depth_s_per_token: float  # after the measured depth

    @property
    def mean_s_per_token(self) -> float:
        return (self.start_s_per_token + self.depth_s_per_token) / 2


@dataclass(frozen=True)
class ChunkChoice:
    chunk_tokens: int
    depth: int
    timings: tuple[ChunkTiming, ...]

    @classmethod
    def from_dict(cls, data: dict) -> ChunkChoice:
        return cls(chunk_tokens=int(data["chunk_tokens"]), depth=int(data["depth"]),
                   timings=tuple(ChunkTiming(**timing) for timing in data["timings"]))


@torch.inference_mode()
def time_chunk_lengths(model: PreTrainedModel, candidates: Sequence[int], depth: int, *,
                       seed: int = 0) -> list[ChunkTiming]:
    """Seconds per token of one chunk of each candidate length, from an empty cache and after `depth` tokens."""
    if not candidates or min(candidates) < 1 or depth < 1:
        raise ValueError(f"candidate lengths and the depth must be positive, got {candidates} and {depth}")
    vocab = model.config.get_text_config(decoder=True).vocab_size
    generator = torch.Generator().manual_seed(seed)
    longest = max(candidates)
    ids = torch.randint(vocab, (depth + longest,), generator=generator).tolist()
    deep = new_cache(model)
    for _ in prefill(model, ids[:depth], longest, deep):  # the deep cache, shared by every candidate's copy
        pass

    def seconds(length: int, cache_at: int) -> float:
        cache = copy.deepcopy(deep) if cache_at else new_cache(model)
        tick = time.perf_counter()
        next(prefill(model, ids[cache_at:cache_at + length], length, cache))
        return time.perf_counter() - tick

    seconds(min(candidates), 0)  # first-call costs (kernel choice, allocations) out of the timings
    return [ChunkTiming(length, seconds(length, 0) / length, seconds(length, depth) / length)
            for length in candidates]


def measured_chunk_tokens(model: PreTrainedModel, model_key: str, *, section_tokens: int, threads: int,
                          folder: Path | None, candidates: Sequence[int] = CANDIDATES) -> ChunkChoice:
    """The fastest candidate no longer than a section, measured at the start and at the depth a section reaches
    (at most MEASURED_DEPTH); read from `folder` when measured before, written there after measuring."""
    fitting = [length for length in candidates if length <= section_tokens] or [section_tokens]
    depth = max(1, min(section_tokens, MEASURED_DEPTH) - max(fitting))
    path = None
    if folder is not None:
        what = json.dumps([model_key, str(model.dtype), threads, fitting, depth])
        # a folder of their own beside the backends' costs, which every JSON file of `folder` is read as
        path = folder / "chunks" / f"{machine_digest()}-{hashlib.sha256(what.encode()).hexdigest()[:12]}.json"
        try:
            return ChunkChoice.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError):  # none yet, or not a file this version wrote
            pass
    timings = time_chunk_lengths(model, fitting, depth)
    best = min(timings, key=lambda timing: timing.mean_s_per_token)
    choice = ChunkChoice(best.chunk_tokens, depth, tuple(timings))
    log.info("chunk length measured: %d tokens (%s)", best.chunk_tokens, ", ".join(
        f"{t.chunk_tokens}: {1 / t.start_s_per_token:,.0f} tok/s at the start, {1 / t.depth_s_per_token:,.0f} "
        f"at depth {depth}" for t in timings))
    if path is not None:
        write_json(path, asdict(choice))
    return choice

