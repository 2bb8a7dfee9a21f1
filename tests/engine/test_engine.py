"""Engine (api.py): a document in, its summary, embeddings and stats out; the caller's progress, check and stop;
settings refused by name; logits and dispatch counts. What the summary and the vectors are, the summarizer's and
the embedder's tests say (test_summarizer.py, test_embedder.py)."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from itertools import pairwise

import numpy as np
import pytest

from npumoe.engine import Engine, EngineSettings, Progress

MOE_LAYERS = 3  # of the tiny qwen3_moe
TOP_K = 8


def test_a_document_gives_a_summary_one_normalised_embedding_per_chunk_plus_the_document(engine, harbour,
                                                                                           summary_prefix):
    result = engine.process(harbour[:600])
    chunks = math.ceil((len(summary_prefix) + 600) / engine.chunk_tokens)
    assert result.embeddings.shape == (chunks + 1, 64)
    assert result.embeddings.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(result.embeddings, axis=1), 1.0, rtol=1e-5)
    assert result.stats.chunks == chunks and result.stats.tokens == 600
    assert result.spans.shape == (chunks, 2)
    assert isinstance(result.summary, str)


def test_stats_name_tokens_chunks_phases_and_dispatch_counts(engine, harbour, summary_prefix):
    stats = engine.process(harbour[:300]).stats
    assert set(stats.seconds) == {"prefill", "summary", "reduce", "total"}
    assert (stats.tokens, stats.chunk_tokens) == (300, engine.chunk_tokens)
    json.dumps(stats.dispatch.to_dict())
    assert {"dropped_fraction", "padding_fraction"} <= stats.dispatch.to_dict().keys()
    # Prefill only (decode is not counted): the prompt prefix and the document, top-8, 3 layers.
    assert stats.dispatch.assignments == (len(summary_prefix) + 300) * TOP_K * MOE_LAYERS == stats.dispatch.cpu
    assert engine.stats is stats.dispatch


def test_a_query_embedded_between_a_documents_chunks_counts_apart_from_the_document(engine, harbour, orchard,
                                                                                    summary_prefix):
    alone = engine.process(harbour[:300])
    queries: list[np.ndarray] = []

    def embed_a_query(progress: Progress) -> None:  # as the daemon answers a search while it processes
        if progress.phase == "prefill" and not queries:
            queries.append(engine.embed(orchard[:100]))

    result = engine.process(harbour[:300], on_progress=embed_a_query)
    assert len(queries) == 1
    assert result.stats.dispatch.to_dict() == alone.stats.dispatch.to_dict()
    assert engine.embedder.stats.assignments == (len(summary_prefix) + 100) * TOP_K * MOE_LAYERS  # the query's own
    np.testing.assert_allclose(result.embeddings, alone.embeddings, atol=1e-6)
    np.testing.assert_allclose(queries[0], engine.embed(orchard[:100]), atol=1e-6)


def test_logits_count_their_own_dispatch(engine):
    ids = list(range(10, 200))
    logits = engine.logits(ids)
    assert logits.shape == (len(ids), engine.loaded.model.config.vocab_size)
    assert engine.stats.layer_calls == math.ceil(len(ids) / engine.chunk_tokens) * MOE_LAYERS


def test_progress_is_reported_after_every_chunk_and_the_summary(engine, harbour, summary_prefix):
    seen: list[Progress] = []
    engine.process(harbour[:700], on_progress=seen.append)
    prefill = [p for p in seen if p.phase == "prefill"]
    step = engine.chunk_tokens
    chunks = math.ceil((len(summary_prefix) + 700) / step)
    assert [p.chunks_done for p in prefill] == list(range(1, chunks + 1))
    assert {p.chunks_total for p in prefill} == {chunks}
    assert [p.tokens_done for p in prefill] == [min(700, i * step - len(summary_prefix)) for i in range(1, chunks + 1)]
    assert {p.tokens_total for p in prefill} == {700}
    assert seen[-1].phase == "summary" and (seen[-1].chunks_done, seen[-1].chunks_total) == (1, 1)
    assert all(a.elapsed_s <= b.elapsed_s for a, b in pairwise(seen))


def test_raising_from_progress_aborts_the_document_and_leaves_the_engine_usable(engine, harbour):
    def stop_after_two(progress: Progress) -> None:
        if progress.chunks_done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        engine.process(harbour[:700], on_progress=stop_after_two)
    assert engine.process(harbour[:200]).stats.tokens == 200


class DecodeSteps:
    """Counts decode steps: `generate` runs the whole model once a step, while prefill runs only its base model."""

    def __init__(self) -> None:
        self.count = 0

    def step(self, *_: object) -> None:
        self.count += 1


@pytest.fixture
def decode_steps(engine) -> Iterator[DecodeSteps]:
    steps = DecodeSteps()
    handle = engine.loaded.model.register_forward_hook(steps.step)
    yield steps
    handle.remove()


class Stopped(Exception):
    """What a caller's check raises to stop the document."""


def test_the_check_runs_before_every_moe_layer_of_every_prefill_chunk(engine, harbour, summary_prefix):
    checks = [0]
    per_chunk: list[int] = []  # checks run up to each chunk's progress report
    engine.process(harbour[:700], check=lambda: checks.__setitem__(0, checks[0] + 1),
                   on_progress=lambda p: per_chunk.append(checks[0]) if p.phase == "prefill" else None)
    chunks = math.ceil((len(summary_prefix) + 700) / engine.chunk_tokens)
    assert per_chunk == [MOE_LAYERS * i for i in range(1, chunks + 1)]


PAUSE_AFTER = 3  # decode steps of the summary before the check pauses


def test_a_pause_during_the_summary_takes_effect_within_one_decode_step(engine, orchard, decode_steps):
    text = orchard[:300]
    unpaused = engine.process(text)
    assert unpaused.stats.generated_tokens > PAUSE_AFTER + 1  # the summary goes on past the pause
    decode_steps.count = 0
    waiting, resume = threading.Event(), threading.Event()
    waited_at: list[int] = []

    def check() -> None:  # pauses once, PAUSE_AFTER steps into the summary, until resumed
        if decode_steps.count >= PAUSE_AFTER and not resume.is_set():
            waited_at.append(decode_steps.count)
            waiting.set()
            resume.wait()

    steps_while_paused: list[int] = []

    def resume_once_waiting() -> None:
        waiting.wait()
        steps_while_paused.append(decode_steps.count)  # the engine is held inside the check
        resume.set()

    resumer = threading.Thread(target=resume_once_waiting)
    resumer.start()
    paused = engine.process(text, check=check)
    resumer.join()
    assert waited_at == [PAUSE_AFTER] and steps_while_paused == [PAUSE_AFTER]  # no further step ran
    assert decode_steps.count > PAUSE_AFTER  # and decoding went on once resumed
    assert paused.summary == unpaused.summary


def test_a_stop_during_a_combine_ends_it_within_one_decode_step(engine, harbour, orchard, decode_steps):
    text = harbour + "\n\n" + orchard  # longer than the context: sections, then their summaries combined
    map_done: list[int] = []  # decode steps when the last section's summary was reported
    stopped_at: list[int] = []

    def on_progress(p: Progress) -> None:
        if p.phase == "summary" and p.chunks_done == p.chunks_total:
            map_done.append(decode_steps.count)

    def check() -> None:
        if map_done and decode_steps.count >= map_done[0] + 2:  # two steps into the first combine
            stopped_at.append(decode_steps.count)
            raise Stopped

    with pytest.raises(Stopped):
        engine.process(text, on_progress=on_progress, check=check)
    assert stopped_at == [map_done[0] + 2] and decode_steps.count == stopped_at[0]  # no further step ran
    assert engine.process(harbour[:200]).stats.tokens == 200  # the check went with the call


@pytest.mark.parametrize("text", ["", "  \n\t "])
def test_an_empty_document_is_refused(engine, text):
    with pytest.raises(ValueError, match="empty or whitespace only"):
        engine.process(text)


@pytest.mark.parametrize(("change", "message"), [
    ({"backend": "tpu"}, "unknown backend 'tpu'"),
    ({"overflow": "drop"}, "overflow must be one of spill, prune"),
    ({"dtype": "float16"}, "dtype must be one of float32, bfloat16"),
    ({"chunk_tokens": -1}, r"chunk_tokens must be 0 \(measured\) or positive"),
    ({"threads": 0}, "threads must be positive"),
    ({"section_tokens": -1}, r"section_tokens must be 0 \(as long as the context allows\) or positive"),
    ({"backend": "coreml"}, "the coreml backend needs compiled_dir"),
    ({"coreml_compute_units": "gpu_only"}, "coreml_compute_units must be one of cpu_and_ne, all"),
])
def test_bad_settings_are_refused_by_name(tiny_model, change, message):
    with pytest.raises(ValueError, match=message):
        EngineSettings(model=str(tiny_model), **change)


def test_bfloat16_runs_and_gives_finite_embeddings(tiny_model, harbour):
    engine = Engine.load(EngineSettings(model=str(tiny_model), dtype="bfloat16", chunk_tokens=128, summary_tokens=4))
    result = engine.process(harbour[:300])
    assert np.isfinite(result.embeddings).all() and result.embeddings.dtype == np.float32


def test_the_model_key_is_the_loaded_checkpoint_key_and_close_restores_eager(tiny_model, reference):
    engine = Engine.load(EngineSettings(model=str(tiny_model)))
    assert engine.model_key == reference.key
    assert engine.loaded.model.config._experts_implementation == "npumoe"
    engine.close()
    assert engine.loaded.model.config._experts_implementation == "eager"
