"""Named geometries are the real models: their configs carry every published size, and the models built
from them have the parameter counts their model cards state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from npumoe.engine.synthetic.geometry import GEOMETRIES, build_layer_model, family_config, layer_experts

GEOMETRIES_FILE = Path(__file__).parents[2] / "engine" / "synthetic" / "geometries.json"
PUBLISHED = json.loads(GEOMETRIES_FILE.read_text())["geometries"]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_built_config_carries_every_published_number(name):
    config = family_config(GEOMETRIES[name])
    for key, value in PUBLISHED[name]["config"].items():
        assert getattr(config, key) == value, key


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_whole_model_has_the_parameter_count_its_model_card_states(name):
    """Every size at once: a wrong head count, FFN or layer pattern would move the total."""
    geometry = GEOMETRIES[name]
    with torch.device("meta"):  # shapes only: a 100B model costs no memory here
        model = AutoModelForCausalLM.from_config(family_config(geometry))
    total = sum(p.numel() for p in model.parameters()) / 1e9
    assert total == pytest.approx(geometry.params_b, rel=0.03)


def test_qwen3_30b_a3b_attention_is_4096_wide_on_a_2048_hidden_size():
    config = family_config(GEOMETRIES["qwen3-30b-a3b"], layers=2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    attention = model.model.layers[0].self_attn
    assert config.head_dim == 128 and config.num_hidden_layers == 2
    assert attention.q_proj.weight.shape == (32 * 128, 2048)
    assert attention.k_proj.weight.shape == (4 * 128, 2048)


@pytest.mark.parametrize(("name", "layers", "pattern"), [
    ("gpt-oss-20b", 3, ["sliding_attention", "full_attention", "sliding_attention"]),
    ("qwen3-next-80b-a3b", 5, ["linear_attention"] * 3 + ["full_attention", "linear_attention"]),
])
def test_fewer_layers_keep_the_first_layers_of_the_real_pattern(name, layers, pattern):
    assert family_config(GEOMETRIES[name], layers=layers).layer_types == pattern


def test_the_one_layer_experts_model_of_a_family_that_starts_dense_still_has_its_experts():
    geometry = GEOMETRIES["deepseek-v2-lite"]
    assert family_config(geometry, layers=1).first_k_dense_replace == 1  # the real model's first layer is dense
    model = build_layer_model(geometry, torch.bfloat16, torch.Generator().manual_seed(0))
    experts = layer_experts(model)
    assert experts.gate_up_proj.shape == (64, 2 * 1408, 2048)
