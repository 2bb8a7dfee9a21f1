"""chunk_tokens = 0: the chunk length measured fastest at a section's start and at depth, cached per machine."""

from __future__ import annotations

import pytest

from npumoe.engine import Engine, EngineSettings, load_model
from npumoe.engine.generate import chunk_length
from npumoe.engine.generate.chunk_length import measured_chunk_tokens, time_chunk_lengths
from npumoe.engine.kernels import choice as mechanism


@pytest.fixture(scope="module")
def folder(tiny) -> str:
    return str(tiny("qwen3_moe"))


def test_each_candidate_is_timed_from_an_empty_cache_and_after_the_depth(folder, monkeypatch):
    model = load_model(folder).model
    runs = []
    prefill = chunk_length.prefill

    def counting(model, ids, chunk_tokens, cache, **kwargs):
        runs.append((len(ids), cache.get_seq_length()))
        return prefill(model, ids, chunk_tokens, cache, **kwargs)

    monkeypatch.setattr(chunk_length, "prefill", counting)
    timings = time_chunk_lengths(model, (32, 64), depth=100)
    assert list(timings) == ["32", "64"] and all(seconds > 0 for seconds in timings.values())
    # the deep cache, a warm-up, then each length (the rounds' first order: last first) from empty and at depth
    assert runs == [(100, 0), (32, 0), (32, 100), (64, 0), (64, 100), (32, 0), (32, 100)]


def test_the_fastest_over_start_and_depth_is_chosen_and_kept_for_the_next_load(folder, tmp_path, monkeypatch):
    model = load_model(folder).model
    calls = []

    def timed(model, candidates, depth):
        calls.append((tuple(candidates), depth))
        rates = {256: 3.0, 512: 2.5, 1024: 4.75}  # seconds per token, the mean of start and depth
        return {str(c): rates[c] for c in candidates}

    monkeypatch.setattr(chunk_length, "time_chunk_lengths", timed)
    monkeypatch.setenv("NPUMOE_CACHE", str(tmp_path))
    choice = measured_chunk_tokens(model, "key", section_tokens=2000, threads=1)
    assert choice.chunk_tokens == 512 and calls == [((256, 512, 1024), 2000 - 1024)]  # 2048 is past the section
    monkeypatch.setattr(mechanism, "_chosen", {})  # a new process: read from the machine's cache
    again = measured_chunk_tokens(model, "key", section_tokens=2000, threads=1)
    assert again == choice and len(calls) == 1  # read back, not measured again
    measured_chunk_tokens(model, "key", section_tokens=2000, threads=2)
    assert len(calls) == 2  # other threads, another measurement


def test_an_engine_set_to_measure_runs_at_the_length_it_measured(folder, tmp_path, monkeypatch):
    monkeypatch.setenv("NPUMOE_CACHE", str(tmp_path))
    engine = Engine.load(EngineSettings(model=folder, chunk_tokens=0, summary_tokens=8))
    choice = engine.chunk_choice
    assert choice is not None and engine.chunk_tokens == choice.chunk_tokens
    assert choice.choice.seconds.keys() == {"256", "512"}  # the candidates a 1,024-token context fits
    result = engine.process("The harbour master logs every ship that enters. " * 30)
    assert result.stats.chunk_tokens == choice.chunk_tokens
    assert list(chunk_length.CHOICES.cached().values()) == [choice.choice]  # kept in the user cache


def test_a_set_length_is_not_measured(folder):
    engine = Engine.load(EngineSettings(model=folder, chunk_tokens=128, summary_tokens=8))
    assert engine.chunk_tokens == 128 and engine.chunk_choice is None
