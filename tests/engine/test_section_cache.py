"""A section's KV cache is made once and written in place, and gives what transformers' growing cache gives."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.cache_utils import DynamicLayer

from npumoe.engine.attach.attention import use_engine_attention
from npumoe.engine.generate.prefill import new_cache, prefill
from npumoe.engine.generate.section_cache import PreallocatedLayer
from npumoe.engine.generate.summary import decode_from_cache

SMALL = {"hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 97, "max_position_embeddings": 256,
         "num_local_experts": 4, "num_experts_per_tok": 2}
CHUNK, DOCUMENT, ANSWER = 12, 40, 10


def _model(**overrides: object) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model("mixtral", **{**SMALL, **overrides})
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _ids(n: int) -> list[int]:
    return torch.randint(SMALL["vocab_size"], (n,), generator=torch.Generator().manual_seed(1)).tolist()


def _decoded(model: torch.nn.Module, cache) -> tuple[torch.Tensor, list[int]]:
    ids = _ids(DOCUMENT)
    hidden = torch.cat(list(prefill(model, ids[:-1], CHUNK, cache)))
    said = decode_from_cache(model, ids, cache, ANSWER, stop_ids=[SMALL["vocab_size"]])  # a stop id never chosen
    return hidden, said


@pytest.mark.parametrize("engine_attention", [False, True], ids=["transformers-attention", "engine-attention"])
def test_a_preallocated_cache_prefills_and_decodes_exactly_what_the_growing_cache_does(engine_attention):
    model = _model()
    if engine_attention:  # its kernels read the cache's views by their strides
        use_engine_attention(model)
    hidden, said = _decoded(model, new_cache(model))
    preallocated = new_cache(model, capacity=DOCUMENT + ANSWER)
    assert all(isinstance(layer, PreallocatedLayer) for layer in preallocated.layers)
    same_hidden, same_said = _decoded(model, preallocated)
    torch.testing.assert_close(same_hidden, hidden, rtol=1e-6, atol=1e-6)
    assert same_said == said and len(said) == ANSWER


def test_decoding_writes_every_token_into_the_same_buffers_and_never_makes_new_ones(monkeypatch):
    model = _model()
    cache = new_cache(model, capacity=DOCUMENT + ANSWER)
    made = []
    original = PreallocatedLayer.lazy_initialization

    def counting(self, key_states, value_states):
        made.append(self)
        original(self, key_states, value_states)

    monkeypatch.setattr(PreallocatedLayer, "lazy_initialization", counting)
    seen: set[tuple[int, int]] = set()
    updates = []
    update = PreallocatedLayer.update

    def watching(self, *args, **kwargs):
        out = update(self, *args, **kwargs)
        seen.add((id(self), self.key_buffer.data_ptr()))
        updates.append(self.length)
        return out

    monkeypatch.setattr(PreallocatedLayer, "update", watching)
    _decoded(model, cache)
    layers = SMALL["num_hidden_layers"]
    assert len(made) == layers  # one pair of buffers per layer, made at its first update
    assert len(seen) == layers  # and every later update, prefill and decode alike, wrote into that pair
    assert max(updates) == DOCUMENT + ANSWER - 1  # the last answer token is not fed back
    assert len(updates) > layers * ANSWER  # decode steps ran through it


def test_a_section_longer_than_its_capacity_grows_the_buffers_and_keeps_what_they_held():
    model = _model()
    reference, said = _decoded(model, new_cache(model))
    small = new_cache(model, capacity=5)
    hidden, same_said = _decoded(model, small)
    torch.testing.assert_close(hidden, reference, rtol=1e-6, atol=1e-6)
    assert same_said == said
    assert all(layer.capacity >= DOCUMENT + ANSWER - 1 for layer in small.layers)


def test_reset_empties_the_cache_and_keeps_its_buffers_for_the_next_section():
    model = _model()
    cache = new_cache(model, capacity=DOCUMENT + ANSWER)
    _decoded(model, cache)
    buffers = [layer.key_buffer.data_ptr() for layer in cache.layers]
    cache.reset()
    assert cache.get_seq_length() == 0
    hidden, _ = _decoded(model, cache)
    assert [layer.key_buffer.data_ptr() for layer in cache.layers] == buffers
    reference, _ = _decoded(model, new_cache(model))
    torch.testing.assert_close(hidden, reference, rtol=1e-6, atol=1e-6)


def test_sliding_window_layers_keep_their_own_bounded_kind():
    model = _model(sliding_window=8)
    cache = new_cache(model, capacity=64)
    assert not any(isinstance(layer, PreallocatedLayer) for layer in cache.layers)
    assert all(isinstance(layer, DynamicLayer) for layer in cache.layers)


def test_a_capacity_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        new_cache(_model(), capacity=0)
