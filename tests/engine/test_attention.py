"""The engine's attention equals the model's own, chunk by chunk with the cache carried, on a grouped-KV
model, on gpt-oss (sinks, sliding-window layers), on Mixtral with a sliding window on every layer and on
Qwen3-Next (linear-attention layers beside full-attention ones), and it is what ran."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from npumoe.engine.attach import attention
from npumoe.engine.attach.attention import IMPLEMENTATIONS, use_engine_attention
from npumoe.engine.generate.prefill import new_cache, prefill

SMALL = {"hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 97, "max_position_embeddings": 256}
FAMILIES = {
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"]},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8},
    "qwen3_next": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 32, "layer_types": ["linear_attention", "full_attention"],
                   "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                   "linear_value_head_dim": 16},
}
CHUNK, DOCUMENT = 12, 40  # four chunks: the last ones attend through the cache, past an 8-token window


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **SMALL, **FAMILIES[family])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    for module in model.modules():  # sinks start at zero; give them weight so they matter
        if hasattr(module, "sinks"):
            module.sinks.data.normal_()
    return model


@pytest.fixture
def counted(monkeypatch):
    calls = {"sdpa": 0, "sinks": 0}
    sdpa, sinks = attention.F.scaled_dot_product_attention, attention._with_sinks

    def counting_sdpa(*args, **kwargs):
        calls["sdpa"] += 1
        return sdpa(*args, **kwargs)

    def counting_sinks(*args, **kwargs):
        calls["sinks"] += 1
        return sinks(*args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", counting_sdpa)
    monkeypatch.setattr(attention, "_with_sinks", counting_sinks)
    return calls


@pytest.mark.parametrize("family", sorted(FAMILIES))
@torch.inference_mode()
def test_chunked_prefill_with_the_engines_attention_equals_eager_on_the_whole_document(family, counted):
    model = _model(family)
    ids = torch.randint(SMALL["vocab_size"], (DOCUMENT,), generator=torch.Generator().manual_seed(1)).tolist()
    model.set_attn_implementation("eager")
    reference = model.base_model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    assert use_engine_attention(model) == "eager" and model.config._attn_implementation == IMPLEMENTATIONS["eager"]
    chunked = torch.cat(list(prefill(model, ids, CHUNK, new_cache(model))))
    assert ((chunked - reference).norm() / reference.norm()).item() < 1e-5
    path = "sinks" if family == "gpt_oss" else "sdpa"
    # every attention layer of every chunk (a linear-attention layer keeps its own recurrence)
    layer_types = getattr(model.config, "layer_types", None) or ["full_attention"] * SMALL["num_hidden_layers"]
    attention_layers = sum(kind != "linear_attention" for kind in layer_types)
    assert attention_layers and counted[path] == -(-DOCUMENT // CHUNK) * attention_layers


def test_a_sliding_window_layer_only_reads_the_keys_its_window_can_see():
    key = torch.randn(1, 2, 30, 4)
    mask = torch.zeros(1, 1, 6, 30, dtype=torch.bool)
    for row in range(6):  # window of 8 ending at each query's position 24 + row
        mask[0, 0, row, 17 + row:25 + row] = True
    kept_key, kept_value, kept_mask = attention._visible_keys(key, -key, mask)
    assert torch.equal(kept_key, key[:, :, 17:]) and torch.equal(kept_value, -key[:, :, 17:])
    assert torch.equal(kept_mask, mask[..., 17:])


def test_a_decode_step_does_not_read_the_room_left_for_tokens_not_decoded_yet():
    key = torch.randn(1, 2, 40, 4)
    mask = torch.zeros(1, 1, 1, 40, dtype=torch.bool)
    mask[..., :25] = True  # a preallocated cache: 25 tokens written, 15 slots still empty
    query = torch.randn(1, 4, 1, 4)
    kept_key, kept_value, kept_mask = attention._visible_keys(key, -key, mask)
    assert kept_key.shape[2] == kept_value.shape[2] == kept_mask.shape[-1] == 25
    whole = F.scaled_dot_product_attention(query, key, -key, attn_mask=mask, enable_gqa=True)
    kept = F.scaled_dot_product_attention(query, kept_key, kept_value, attn_mask=kept_mask, enable_gqa=True)
    assert torch.allclose(kept, whole, rtol=1e-6, atol=1e-7)


def test_a_model_whose_attention_it_cannot_stand_in_for_keeps_its_own():
    model = _model("qwen3_moe")
    model.config._attn_implementation = "flex_attention"
    assert use_engine_attention(model) is None and model.config._attn_implementation == "flex_attention"
