"""Decode speed: greedy tokens per second from a prefilled KV cache, per weights format, through the engine.

A summary is decoded token by token after its section's prefill, and that is most of a document's time. Here the
sample documents' text is prefilled to `depth` tokens, then `tokens` are decoded greedily through the engine's
decode path (`MoeRuntime.decoding()`, `decode_from_cache`), as the summarizer does. Every format's engine is loaded
in one process and the rounds interleave them, so the machine's drift (other processes on a shared machine) moves
all alike; each row reports the median tokens/s over the rounds and their range.

`head_torch` adds, per format, rounds with the LM head run by plain torch (`HeadRows`, as before the head took the
projections' kernel choice), interleaved with the others: the A/B of that change. `profile` charges one decode
run's time to the model's parts (profile.py's hooks) and reports milliseconds per step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from npumoe.engine.api import Engine, EngineSettings
from npumoe.engine.attach.projections import HeadRows
from npumoe.engine.generate.prefill import new_cache, prefill
from npumoe.engine.generate.summary import decode_from_cache, stop_ids

from .profile import PARTS, ChunkProfile, PartTimer, counted_attention, timed_cache

ENGINE_HEAD = "engine head"
TORCH_HEAD = "torch head"


@dataclass(frozen=True)
class DecodeSettings:
    depth: int  # tokens in the cache when decoding starts
    tokens: int  # tokens decoded per round
    rounds: int
    threads: int
    head_torch: bool = False  # also run each format with the LM head on plain torch (the A/B of the head's kernel)
    profile: bool = False


def prompt_ids(engine: Engine, depth: int) -> list[int]:
    """The sample documents' text as `depth` token ids (repeated when shorter)."""
    from npumoe.daemon.samples import sample_documents

    text = "\n\n".join(p for doc in sample_documents() for p in doc.paragraphs)
    ids = engine.loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    return (ids * (depth // len(ids) + 1))[:depth]


@contextmanager
def torch_head(engine: Engine) -> Iterator[None]:
    """The model's LM head run by plain torch (`HeadRows` over its original Linear) inside the block."""
    model = engine.loaded.model
    head = model.get_output_embeddings()
    name = next(name for name, module in model.named_modules() if module is head)
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    setattr(parent, leaf, HeadRows(getattr(head, "original", head)))
    try:
        yield
    finally:
        setattr(parent, leaf, head)


def decode_once(engine: Engine, ids: Sequence[int], tokens: int,
                timer: PartTimer | None = None) -> tuple[float, list[int], ChunkProfile | None]:
    """Prefill all but the last of `ids`, then decode `tokens` greedily (fewer if the model stops): (seconds
    decoding, the tokens, and with `timer` the decoding's parts; the prefill is not profiled)."""
    model = engine.loaded.model
    cache = new_cache(model, capacity=len(ids) + tokens + 1)
    with torch.inference_mode():
        for _ in prefill(model, ids[:-1], engine.chunk_tokens, cache):
            pass
        if timer is not None:
            timed_cache(cache, timer)
        started = time.perf_counter()
        with engine.runtime.decoding(), timer.chunk(len(ids), tokens) if timer else nullcontext() as profile:
            said = decode_from_cache(model, ids, cache, tokens, stop_ids(model, engine.loaded.tokenizer))
        return time.perf_counter() - started, said, profile


def profile_decode(engine: Engine, ids: Sequence[int], tokens: int) -> dict[str, float]:
    """Milliseconds per decode step charged to each part (profile.py's parts)."""
    model = engine.loaded.model
    timer = PartTimer(model)
    try:
        with counted_attention(model, timer):
            _, said, profile = decode_once(engine, ids, tokens, timer)
    finally:
        timer.close()
    steps = max(1, len(said))
    return {part: round(profile.parts[part].seconds * 1e3 / steps, 2) for part in PARTS if part in profile.parts}


def run_decode_bench(model: str, formats: Sequence[str], settings: DecodeSettings, *,
                     on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """One row per (format, head) case: tokens/s median and range over interleaved rounds."""
    torch.set_num_threads(settings.threads)
    engines = {f: Engine.load(EngineSettings(model=model, weights=f, threads=settings.threads)) for f in formats}
    ids = prompt_ids(next(iter(engines.values())), settings.depth)
    cases = [(f, ENGINE_HEAD) for f in formats] + ([(f, TORCH_HEAD) for f in formats] if settings.head_torch else [])
    rates: dict[tuple[str, str], list[float]] = {case: [] for case in cases}
    said: dict[tuple[str, str], list[int]] = {}
    for case in cases:  # warm-up: first-call costs (kernel choices read or timed) out of the rounds
        with torch_head(engines[case[0]]) if case[1] == TORCH_HEAD else nullcontext():
            decode_once(engines[case[0]], ids, 4)
    for r in range(settings.rounds):
        for case in cases if r % 2 == 0 else cases[::-1]:  # alternate the order: neither side always goes first
            engine = engines[case[0]]
            with torch_head(engine) if case[1] == TORCH_HEAD else nullcontext():
                seconds, tokens, _ = decode_once(engine, ids, settings.tokens)
            rates[case].append(len(tokens) / seconds)
            said[case] = tokens
    rows = []
    for (f, head), values in rates.items():
        engine = engines[f]
        projection = engine.loaded.model.get_output_embeddings()
        row = {"model": engine.loaded.name, "weights": f, "head": head,
               "head_kernel": "torch" if head == TORCH_HEAD else getattr(projection, "kernel", "torch"),
               "depth": settings.depth, "tokens": len(said[(f, head)]), "threads": settings.threads,
               "rounds": settings.rounds, "tok_s": round(statistics.median(values), 2),
               "tok_s_min": round(min(values), 2), "tok_s_max": round(max(values), 2),
               "text": engine.loaded.tokenizer.decode(said[(f, head)][:24]).replace("\n", " ")}
        if settings.profile and head == ENGINE_HEAD:
            row["ms_per_step"] = profile_decode(engine, ids, settings.tokens)
        rows.append(row)
        if on_result is not None:
            on_result(row)
    return rows
