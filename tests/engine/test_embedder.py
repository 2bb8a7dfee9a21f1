"""The embedder (generate/embedder.py): chunk vectors pooled from the summary's own prefill, a query's vector made
the same way, every pooling cut into the same chunks, and the characters each chunk came from."""

from __future__ import annotations

import math
from itertools import pairwise

import numpy as np
import pytest
import torch

from npumoe.engine.generate import embedder as embedder_module
from npumoe.engine.vocabulary import LAST, MEAN, POOLINGS, PROMPT


def test_embeddings_are_mean_pooled_final_hidden_states_as_one_uncached_forward_gives_them(
        engine, reference, harbour, summary_prefix):
    text = harbour[:500]
    result = engine.process(text)
    ids = summary_prefix + list(text.encode())
    with torch.no_grad():
        hidden = reference.model.base_model(torch.tensor([ids])).last_hidden_state[0]  # (P + 500, H)
    # Chunks cut the prefilled stream (prefix, then document); each pools its document tokens.
    step = engine.chunk_tokens
    document_chunks = [c[max(0, len(summary_prefix) - i * step):] for i, c in enumerate(hidden.split(step))]
    chunk_means = torch.stack([c.mean(0) for c in document_chunks])
    document = hidden[len(summary_prefix):].mean(0, keepdim=True)
    expected = torch.nn.functional.normalize(torch.cat([chunk_means, document]), dim=-1)
    np.testing.assert_allclose(result.embeddings, expected.numpy(), atol=1e-4)


@pytest.mark.parametrize("length", [300, 700])
def test_a_texts_vector_is_made_the_way_a_documents_vector_is(engine, harbour, orchard, length):
    text = harbour[:length]
    vector = engine.embed(text)
    assert vector.shape == (64,) and vector.dtype == np.float32
    np.testing.assert_allclose(vector, engine.process(text).embeddings[-1], atol=1e-5)
    assert float(vector @ engine.embed(orchard[:length])) < 0.9999  # another text, another vector


def test_a_text_longer_than_a_section_is_embedded_section_by_section(engine, harbour, orchard):
    text = harbour + "\n\n" + orchard
    result = engine.process(text)
    assert result.stats.sections >= 2
    np.testing.assert_allclose(engine.embed(text), result.embeddings[-1], atol=1e-5)


def test_every_pooling_cuts_a_document_into_the_same_chunks_and_gives_its_own_vectors(engine, harbour):
    made = {pooling: engine.embed_document(harbour[:700], pooling) for pooling in POOLINGS}
    for embeddings, spans in made.values():
        np.testing.assert_array_equal(spans, made[MEAN][1])  # the one-word prompt's chunks are counted, not prefilled
        assert embeddings.shape == made[MEAN][0].shape
        np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, rtol=1e-5)
    assert not np.allclose(made[LAST][0], made[MEAN][0]) and not np.allclose(made[PROMPT][0], made[LAST][0])


def test_a_query_counts_its_own_dispatch(engine, harbour, summary_prefix):
    engine.embed(harbour[:200])
    assert engine.embedder.stats.layer_calls == math.ceil((len(summary_prefix) + 200) / engine.chunk_tokens) * 3


def test_an_empty_text_is_not_embedded(engine):
    with pytest.raises(ValueError, match="empty or whitespace only"):
        engine.embed(" \n")


def test_each_chunk_knows_the_characters_its_tokens_came_from(engine, harbour, summary_prefix):
    text = "Grüße — " + harbour[:600]  # multi-byte characters: one character, several byte tokens
    result = engine.process(text)
    spans = result.spans.tolist()
    assert len(spans) == result.stats.chunks and result.spans.dtype == np.int64
    assert spans[0][0] == 0 and spans[-1][1] == len(text)
    assert all(a[1] <= b[0] + 1 for a, b in pairwise(spans))  # consecutive (a split character is in both)
    ascii_spans = engine.process(harbour[:600]).spans  # one byte, one token, one character
    sizes = [engine.chunk_tokens - len(summary_prefix), *[engine.chunk_tokens] * (len(ascii_spans) - 2)]
    assert (ascii_spans[:-1, 1] - ascii_spans[:-1, 0]).tolist() == sizes


def test_spans_come_from_decoded_lengths_for_a_tokenizer_without_offsets(engine, harbour, monkeypatch):
    with_offsets = engine.process(harbour[:600]).spans
    calls = []
    decoded_spans = embedder_module._decoded_spans
    monkeypatch.setattr(embedder_module, "_decoded_spans", lambda *args: calls.append(args) or decoded_spans(*args))
    monkeypatch.setattr(type(engine.loaded.tokenizer), "is_fast", property(lambda self: False))
    decoded = engine.process(harbour[:600]).spans
    assert len(calls) == 1
    np.testing.assert_array_equal(decoded, with_offsets)  # ASCII: a chunk's decoded length is its byte count
