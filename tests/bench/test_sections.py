"""`bench sections`: one document through the api at several section lengths, vectors compared to the longest."""

from __future__ import annotations

import numpy as np
import pytest

from npumoe.bench.sections import SectionBenchSettings, choose, chunk_cosines, compare_sections, sample_text
from npumoe.engine import api as engine_module


def test_each_section_length_runs_the_engine_and_is_compared_with_the_longest(tiny, monkeypatch):
    processed = []
    process = engine_module.Engine.process

    def counting(self, text, *args, **kwargs):
        result = process(self, text, *args, **kwargs)
        processed.append((self.section_tokens, result.stats.tokens))
        return result

    monkeypatch.setattr(engine_module.Engine, "process", counting)
    settings = SectionBenchSettings(document_tokens=600, section_tokens=(200, 0), chunk_tokens=128,
                                    summary_tokens=4, weights="fp32")
    reference, short = compare_sections(tiny("qwen3_moe"), settings)
    # a warm-up and the document per length, the longest (0: the context) first
    assert [tokens for _, tokens in processed] == [128, 600, 128, 600]
    assert processed[1][0] > 600 and processed[3][0] == 200
    assert (reference["section_tokens"], reference["sections"], reference["reduce_rounds"]) == (0, 1, 0)
    assert (short["section_tokens"], short["sections"]) == (200, 3) and short["reduce_rounds"] >= 1
    assert reference["document_cosine"] == pytest.approx(1.0) and reference["chunk_cosine_min"] == pytest.approx(1.0)
    assert short["document_cosine"] < 1.0 and short["chunk_cosine_min"] < short["chunk_cosine_mean"] <= 1.0
    assert sum(row["chosen"] for row in (reference, short)) == 1
    assert reference["speedup"] == 1.0 and short["speedup"] == short["tokens_per_s"] / reference["tokens_per_s"]


def test_a_chunk_is_compared_with_the_reference_chunk_holding_its_middle():
    reference_rows = np.eye(3, dtype=np.float32)
    reference_spans = np.array([[0, 10], [10, 20], [20, 30]])
    rows = np.array([[1, 0, 0], [0, 0, 1], [0, 1, 0]], dtype=np.float32)
    spans = np.array([[0, 8], [8, 24], [24, 30]])  # middles 4, 16, 27: reference chunks 0, 1, 2
    np.testing.assert_allclose(chunk_cosines(rows, spans, reference_rows, reference_spans), [1, 0, 0])


def test_the_choice_is_the_fastest_that_keeps_the_document_vector():
    rows = [{"tokens_per_s": 100.0, "document_cosine": 1.0}, {"tokens_per_s": 130.0, "document_cosine": 0.995},
            {"tokens_per_s": 150.0, "document_cosine": 0.9}]
    assert choose(rows) is rows[1]


def test_the_sample_text_has_the_tokens_asked_for():
    assert len(sample_text(5000).encode()) == 5000


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="section lengths"):
        SectionBenchSettings(section_tokens=(-1,))
