"""Calibration: routed tokens per expert per chunk, counted over full chunks, in windows of the context."""

from __future__ import annotations

import pytest

from npumoe.engine.calibration.calibrate import calibrate
from npumoe.engine.loading.load import load_model


@pytest.fixture(scope="module")
def qwen2(tiny):
    return load_model(tiny("qwen2_moe"))


def test_every_counted_chunk_routes_chunk_length_times_top_k_assignments(qwen2, harbour):
    calibration = calibrate(qwen2, [("harbour", harbour)], chunk_tokens=128)
    top_k = qwen2.model.config.num_experts_per_tok
    assert [name for name, _ in calibration.layers] == [f"model.layers.{i}.mlp.experts" for i in range(3)]
    for _, load in calibration.layers:
        assert len(load.mean) == 16
        assert sum(load.mean) == pytest.approx(128 * top_k, abs=0.01)
        for p50, p95, most in zip(load.p50, load.p95, load.max, strict=True):
            assert 0 <= p50 <= p95 <= most <= 128


def test_only_full_chunks_are_counted(qwen2):
    calibration = calibrate(qwen2, [("short", "x" * 300)], chunk_tokens=128)
    assert calibration.tokens == 301  # the text's bytes and one end-of-text
    assert calibration.chunks == 2


def test_a_text_shorter_than_one_chunk_is_counted_as_it_is(qwen2):
    calibration = calibrate(qwen2, [("tiny", "y" * 50)], chunk_tokens=128)
    assert calibration.chunks == 1
    assert sum(calibration.layers[0][1].mean) == pytest.approx(51 * qwen2.model.config.num_experts_per_tok)


def test_text_longer_than_the_context_is_prefilled_in_windows_with_progress_per_chunk(qwen2, harbour, orchard):
    seen = []
    calibration = calibrate(qwen2, [("harbour", harbour), ("orchard", orchard)], chunk_tokens=256,
                            on_chunk=lambda done, total: seen.append((done, total)))
    tokens = len(harbour.encode()) + len(orchard.encode()) + 2
    assert calibration.tokens == tokens > qwen2.context_tokens
    # Windows of 1024 tokens (4 chunks each) and a last, shorter window.
    full_windows, rest = divmod(tokens, 1024)
    assert calibration.chunks == 4 * full_windows + rest // 256
    total = 4 * full_windows + -(-rest // 256)
    assert seen == [(done, total) for done in range(1, total + 1)]
    assert calibration.sources == ("harbour", "orchard")


def test_calibration_gives_the_model_back_its_experts_implementation(qwen2):
    calibrate(qwen2, [("text", "some text")], chunk_tokens=8)
    assert qwen2.model.config._experts_implementation == "eager"


def test_empty_calibration_data_is_refused(qwen2):
    with pytest.raises(ValueError, match="calibration data holds no text"):
        calibrate(qwen2, [("empty", "")], chunk_tokens=128)


def test_a_chunk_longer_than_the_context_is_refused(qwen2):
    with pytest.raises(ValueError, match="chunk length 2048 exceeds the model's context"):
        calibrate(qwen2, [("text", "text")], chunk_tokens=2048)
