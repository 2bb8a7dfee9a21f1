"""Loading checkpoints, the project's tokenizer, and the tiny skewed checkpoints of every family."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, Llama4TextConfig, LlamaConfig, MiniMaxConfig
from transformers.models.minimax.modeling_minimax import MiniMaxCache

from npumoe.engine.attach.runtime import MoeRuntime
from npumoe.engine.backends.registry import get_backend
from npumoe.engine.errors import ModelError
from npumoe.engine.generate.prefill import new_cache, prefill
from npumoe.engine.loading.load import load_model
from npumoe.engine.moe.model_experts import moe_experts, moe_layouts
from npumoe.engine.synthetic.byte_tokenizer import build_byte_tokenizer
from npumoe.engine.synthetic.tiny import ARCHITECTURES, make_tiny


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_every_tiny_architecture_reloads_through_from_pretrained(tiny, arch):
    loaded = load_model(tiny(arch))
    config = json.loads((tiny(arch) / "config.json").read_text())
    assert loaded.family == config["model_type"] == arch
    assert loaded.context_tokens == 1024
    experts = moe_experts(loaded.model)
    assert len(experts) == 3
    assert 8 <= experts[0][1].num_experts <= 32
    assert loaded.model.config.num_experts_per_tok == ARCHITECTURES[arch][1]["num_experts_per_tok"]
    layouts = [layout for _, _, layout in moe_layouts(loaded.model)]
    assert layouts == [layouts[0]] * 3  # one layout per model, read off each experts module


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_tiny_routers_are_skewed_so_the_hottest_expert_carries_several_times_the_mean(tiny, harbour, arch):
    loaded = load_model(tiny(arch))
    runtime = MoeRuntime(loaded.model, get_backend("cpu"))
    ids = loaded.tokenizer(harbour)["input_ids"]
    with runtime.recording_loads() as loads:
        for _ in prefill(loaded.model, ids, 256, new_cache(loaded.model)):
            pass
    runtime.detach()
    for calls in loads:
        per_expert = torch.stack(calls).sum(0).float()
        assert per_expert.max() >= 3 * per_expert.mean()


def test_the_same_seed_makes_the_same_checkpoint_and_another_seed_another(tiny, tmp_path):
    again = make_tiny("mixtral", tmp_path / "again", seed=0)
    assert load_model(again).key.split("@")[1] == load_model(tiny("mixtral")).key.split("@")[1]
    assert load_model(tiny("mixtral", seed=1)).key.split("@")[1] != load_model(tiny("mixtral")).key.split("@")[1]


def test_the_model_key_names_the_folder_and_fingerprints_the_weights(tiny):
    key = load_model(tiny("olmoe")).key
    name, digest = key.split("@")
    assert name == "model" and len(digest) == 16


def test_byte_tokenizer_maps_each_utf8_byte_to_its_value_and_round_trips():
    tokenizer = build_byte_tokenizer()
    text = "Grüße, 世界!\n\ttabs"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode())
    assert tokenizer.decode(ids) == text


def test_byte_tokenizer_has_a_chatml_template_with_special_tokens():
    tokenizer = build_byte_tokenizer()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer(prompt, add_special_tokens=False)["input_ids"][0] == tokenizer.convert_tokens_to_ids(
        "<|im_start|>")
    assert tokenizer.eos_token == "<|im_end|>"


def test_an_id_missing_from_the_local_cache_is_a_clear_error_and_nothing_is_downloaded(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelError, match="nope/not-a-model: not a local model folder nor in the local Hugging Face"):
        load_model("nope/not-a-model")
    assert not (tmp_path / "hub").exists() or not any((tmp_path / "hub").iterdir())


def test_a_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ModelError, match=r"has no config\.json"):
        load_model(tmp_path)


def test_a_dense_checkpoint_loads_and_runs_through_the_engine_with_no_experts_to_route(tmp_path):
    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    build_byte_tokenizer().save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    ids = torch.arange(3, 40)[None]
    with torch.inference_mode():
        before = loaded.model(ids).logits
        runtime = MoeRuntime(loaded.model, get_backend("cpu"))
        assert runtime.layers == [] and runtime._running() is runtime
        assert torch.allclose(loaded.model(ids).logits, before, atol=1e-4)
    runtime.detach()
    assert runtime._running() is None
    with pytest.raises(ModelError, match=r"LlamaForCausalLM has no routed-experts modules .* a dense model"):
        moe_layouts(loaded.model)  # what a plan or calibration needs


def test_experts_outside_transformers_experts_interface_are_refused_at_load_in_one_line_naming_the_module(tmp_path):
    """Llama 4's experts class is not wrapped by `use_experts_implementation` (its forward takes every expert's
    router-scaled inputs, not the router's choice), so the engine cannot take it over without patching."""
    config = Llama4TextConfig(vocab_size=300, hidden_size=32, intermediate_size=16, intermediate_size_mlp=64,
                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                              num_local_experts=4)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    build_byte_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ModelError) as refused:
        load_model(tmp_path)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"{tmp_path.name}: model.layers.0.feed_forward.experts (Llama4TextExperts): "
                              "not wrapped by transformers' experts interface (use_experts_implementation)")


def test_an_unknown_dtype_is_refused(tiny):
    with pytest.raises(ModelError, match="dtype must be one of float32, bfloat16"):
        load_model(tiny("mixtral"), dtype="float16")


def test_make_tiny_refuses_an_unknown_architecture(tmp_path):
    with pytest.raises(ValueError, match="unknown architecture 'llama'"):
        make_tiny("llama", tmp_path)


def test_a_model_that_keeps_a_cache_class_of_its_own_gets_that_class_as_generate_leaves_it_to_the_model():
    """MiniMax's forward makes a MiniMaxCache itself and refuses any other; `generate` leaves the cache to it."""
    config = MiniMaxConfig(vocab_size=300, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_local_experts=4,
                           layer_types=["linear_attention", "full_attention"])
    model = AutoModelForCausalLM.from_config(config).eval()
    cache = new_cache(model)
    assert type(cache) is MiniMaxCache
    ids = list(range(3, 40))
    first, second = prefill(model, ids, 20, cache, logits=True)  # the model takes it, and keeps filling it
    assert first.shape == (20, 300) and second.shape == (17, 300)
    assert cache.get_seq_length(1) == len(ids)  # the attention layer's keys and values
    assert isinstance(cache.linear_cache[0], torch.Tensor)  # the linear-attention layer's state
