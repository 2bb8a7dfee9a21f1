"""The target written as random blocks: a tiny geometry the same way as the full one, loaded back through the engine's
own GGUF loading, block for block."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from npumoe.engine.formats.gguf_blocks import CONVERSIONS, MAPPED
from npumoe.engine.loading.gguf_load import gguf_model
from npumoe.engine.loading.load import load_model
from npumoe.engine.moe.model_experts import moe_experts
from npumoe.engine.synthetic.byte_tokenizer import build_byte_tokenizer
from npumoe.engine.synthetic.geometry import GEOMETRIES, parse_geometry
from npumoe.engine.synthetic.gguf_writer import VALUES_AT_ONCE
from npumoe.engine.synthetic.random_gguf import Q4_0, Q8_0, random_gguf_layout, write_random_gguf

TINY = {"vocab_size": 320, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 64, "max_position_embeddings": 512}


def _write(path, qtype, **kwargs):
    """Two layers of a tiny Qwen3-MoE geometry with the project's byte tokenizer (fewer tokens than its vocabulary)."""
    config, tensors = random_gguf_layout(parse_geometry("64x8x2x32"), qtype, layers=2, **TINY)
    return write_random_gguf(path, config, tensors, build_byte_tokenizer(), **kwargs), tensors


@pytest.mark.parametrize("qtype", [Q8_0, Q4_0])
def test_the_random_blocks_load_through_the_engine_as_written(tmp_path, qtype):
    file, _ = _write(tmp_path / "target.gguf", qtype)
    model = gguf_model(file, torch.float32, experts_implementation="eager")
    stored = {tensor.name: tensor for tensor in gguf.GGUFReader(file).tensors}

    def blocks(name: str) -> torch.Tensor:
        tensor = stored[name]
        assert tensor.tensor_type == qtype
        return torch.from_numpy(gguf.quants.dequantize(tensor.data, qtype))

    experts = moe_experts(model)[1][1]
    gate_up = torch.cat([blocks("blk.1.ffn_gate_exps.weight"), blocks("blk.1.ffn_up_exps.weight")], dim=1)
    assert torch.equal(experts.gate_up_proj, gate_up)
    assert torch.equal(experts.down_proj, blocks("blk.1.ffn_down_exps.weight"))
    attention = model.model.layers[0].self_attn
    assert torch.equal(attention.o_proj.weight, blocks("blk.0.attn_output.weight"))
    assert torch.equal(model.model.layers[0].input_layernorm.weight, torch.ones(64))
    # each weight drawn with a standard deviation of about 1/sqrt(fan-in), the scales differing block to block
    assert experts.down_proj.std() == pytest.approx(32**-0.5, rel=0.2)
    assert gate_up.std() == pytest.approx(64**-0.5, rel=0.2)
    scales = stored["blk.1.ffn_down_exps.weight"].data.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])[:, :2]
    assert len(np.unique(scales.copy().view(np.float16))) > 100


def test_experts_in_random_q4_0_blocks_map_into_int4_without_a_float_copy(tmp_path):
    file, _ = _write(tmp_path / "target.gguf", Q4_0)
    CONVERSIONS.clear()
    loaded = load_model(file, dtype="float32", pack=True, format="int4")
    assert dict(CONVERSIONS) == {MAPPED: 3 * 8 * len(moe_experts(loaded.model))}


def test_the_file_is_written_a_few_rows_at_a_time_and_holds_exactly_its_tensors(tmp_path):
    parts: list[int] = []
    file, tensors = _write(tmp_path / "target.gguf", Q8_0, progress=parts.append)
    assert sum(parts) == sum(tensor.nbytes for tensor in tensors)
    assert max(parts) <= VALUES_AT_ONCE  # bytes of a part: fewer than its values in any block type
    assert [t.name for t in gguf.GGUFReader(file).tensors] == [t.name for t in tensors]


def test_a_tokenizer_narrower_than_the_vocabulary_is_padded_and_reads_back_the_same(tmp_path):
    tokenizer = build_byte_tokenizer()
    assert len(tokenizer) < TINY["vocab_size"]
    file, _ = _write(tmp_path / "target.gguf", Q8_0)
    loaded = load_model(file)
    assert loaded.tokenizer("hello <|im_start|>").input_ids == tokenizer("hello <|im_start|>").input_ids
    assert loaded.model.config.vocab_size == TINY["vocab_size"]


@pytest.mark.slow  # the full model built on the meta device: about 40 s
def test_the_full_target_lays_out_qwen3_30b_a3b_at_about_17_gb_in_q4_0():
    config, tensors = random_gguf_layout(GEOMETRIES["qwen3-30b-a3b"], Q4_0)
    assert (config.num_hidden_layers, config.num_experts, config.num_experts_per_tok) == (48, 128, 8)
    names = {tensor.name: tensor for tensor in tensors}
    assert names["blk.47.ffn_down_exps.weight"].shape == (128, 2048, 768)
    assert names["token_embd.weight"].shape == (151936, 2048)
    values = sum(np.prod(tensor.shape) for tensor in tensors)
    assert values / 1e9 == pytest.approx(GEOMETRIES["qwen3-30b-a3b"].params_b, rel=0.01)
    assert sum(tensor.nbytes for tensor in tensors) / 1e9 == pytest.approx(17.2, rel=0.03)
