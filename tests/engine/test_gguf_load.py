"""GGUF files: the model transformers reads from the same file, experts whose blocks the engine's formats express
mapped into them with no float copy, other block types dequantized and quantized again, a stable key; qwen3moe,
qwen2moe (with its shared expert), llama, and Mixtral's experts in a llama file."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from support.gguf_logits import logits, reference_logits
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, get_gguf_hf_weights_map

from npumoe.engine.attach.runtime import MoeRuntime
from npumoe.engine.backends.registry import get_backend
from npumoe.engine.errors import ModelError
from npumoe.engine.formats import gguf_blocks
from npumoe.engine.formats.gguf_blocks import CONVERSIONS, DEQUANTIZED, MAPPED, engine_weight
from npumoe.engine.formats.quantize import pack_int4, quantize, unpack_int4
from npumoe.engine.loading import gguf_header, gguf_load
from npumoe.engine.loading.gguf_load import gguf_model
from npumoe.engine.loading.load import load_model
from npumoe.engine.loading.model_size import checkpoint_tensors, model_size
from npumoe.engine.loading.resolve import model_key
from npumoe.engine.moe.model_experts import moe_experts
from npumoe.engine.synthetic.byte_tokenizer import build_byte_tokenizer
from npumoe.engine.synthetic.gguf_writer import write_gguf

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    """A tiny dense llama (the demo model's family), saved with the project's byte tokenizer."""
    tokenizer = build_byte_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("llama") / "model"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder




@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_a_qwen3_moe_gguf_loads_as_transformers_reads_it(tiny, tmp_path, qtype):
    file = write_gguf(tiny("qwen3_moe"), tmp_path / "model.gguf", experts=qtype, weights=qtype)
    loaded = load_model(file)
    assert loaded.name == "model.gguf" and loaded.path == file.resolve() and loaded.streamed
    assert (logits(loaded.model) - reference_logits(file)).abs().max() < 1e-4
    assert loaded.tokenizer("hello <|im_start|>").input_ids == [104, 101, 108, 108, 111, 32, 257]
    assert "<|im_start|>" in loaded.tokenizer.chat_template  # from the file's metadata


def test_the_engine_parses_a_gguf_header_once_a_load_lets_it_go_and_parses_a_changed_file_again(tiny, tmp_path,
                                                                                                 monkeypatch):
    file = write_gguf(tiny("qwen3_moe"), tmp_path / "model.gguf", experts=Q.Q8_0, weights=Q.Q8_0)
    gguf_header._reader.cache_clear()
    parses = []  # the engine's own (transformers parses the file apart, for the tokenizer)
    real = gguf_header.check_header

    def parse(path):
        parses.append(path)
        return real(path)

    monkeypatch.setattr(gguf_header, "check_header", parse)
    load_model(file)
    assert len(parses) == 1  # the config and the tensors read from one parse
    assert gguf_header._reader.cache_info().currsize == 0  # not held while the model runs
    gguf_header.read_gguf(file)
    gguf_header.read_gguf(file)
    file.write_bytes(file.read_bytes()[:-1] + b"\0")  # rewritten: a new file as far as the cache knows
    gguf_header.read_gguf(file)
    assert len(parses) == 3


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_a_llama_gguf_loads_as_transformers_reads_it(tiny_llama, tmp_path, qtype):
    file = write_gguf(tiny_llama, tmp_path / "llama.gguf", weights=qtype)
    model = gguf_model(file, torch.float32, experts_implementation="eager")
    assert (logits(model) - reference_logits(file)).abs().max() < 1e-4


@pytest.mark.parametrize(("qtype", "format"), [(Q.Q8_0, "int8"), (Q.Q4_0, "int4"), (Q.Q4_1, "int4")])
def test_experts_in_blocks_the_formats_express_are_mapped_into_them_without_a_float_copy(tiny, tmp_path,
                                                                                        monkeypatch, qtype, format):
    file = write_gguf(tiny("qwen3_moe"), tmp_path / "model.gguf", experts=qtype, weights=Q.F16)
    floats: list[int] = []
    quantize_ = gguf_blocks.quantize
    monkeypatch.setattr(gguf_blocks, "quantize", lambda w, f: floats.append(w.shape[0]) or quantize_(w, f))
    CONVERSIONS.clear()
    loaded = load_model(file, dtype="float32", pack=True, format=format)
    modules = moe_experts(loaded.model)
    experts = len(modules) * loaded.model.config.num_experts
    assert dict(CONVERSIONS) == {MAPPED: 3 * experts}  # gate, up and down of every expert, none dequantized
    # Q4: no float weight at all; Q8_0: rescaled from its codes a few rows at a time
    assert floats == [] if format == "int4" else max(floats) <= gguf_blocks.ROWS_AT_ONCE
    MoeRuntime(loaded.model, get_backend("cpu"), quantized=format, release=True)
    reference = reference_logits(file)
    error = (logits(loaded.model) - reference).norm() / reference.norm()
    # measured 0.7-1%: the kernels round the activations (int8 dynamic kernels) and int4 keeps bf16 scales
    assert error < 0.03


@pytest.fixture(scope="module")
def wide_moe(tmp_path_factory) -> Path:
    """A tiny qwen3 MoE whose widths are whole Q4_K super-blocks of 256 (the tiny models' 64 are not)."""
    tokenizer = build_byte_tokenizer()
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=256, intermediate_size=512, max_position_embeddings=1024,
                            norm_topk_prob=True, tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("wide") / "model"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_q4_k_files_experts_load_into_int4_mapped_from_their_codes(wide_moe, tmp_path, monkeypatch):
    file = write_gguf(wide_moe, tmp_path / "model.gguf", experts=Q.Q4_K, weights=Q.F16,
                      file_type=gguf.LlamaFileType.MOSTLY_Q4_K_M)
    floats: list[int] = []
    monkeypatch.setattr(gguf_blocks, "quantize", lambda *a, **k: floats.append(1))
    CONVERSIONS.clear()
    loaded = load_model(file, dtype="float32", pack=True, format="int4")
    experts = len(moe_experts(loaded.model)) * loaded.model.config.num_experts
    assert dict(CONVERSIONS) == {MAPPED: 3 * experts} and floats == []  # no weight quantized from float
    MoeRuntime(loaded.model, get_backend("cpu"), quantized="int4", release=True)
    reference = reference_logits(file)  # transformers dequantizes the Q4_K blocks with the gguf package
    # measured 3.6 %, nearly all of it the kernels' int8 rounding of the activations (a Q4_0 file of this model
    # through the same kernels: 5.2 %); the experts' weights are 0.18 % off the file's, the bf16 scales and zeros
    assert (logits(loaded.model) - reference).norm() / reference.norm() < 0.05


def test_q4_0_codes_pair_as_the_engines_nibbles(tmp_path):
    # scales that are powers of two (exact in bf16): the engine's weight is the file's, value for value
    rng = np.random.default_rng(0)
    codes = rng.integers(-8, 8, size=(4, 64)).astype(np.float32)
    codes[:, ::32] = -8  # each block's largest magnitude: d = -(-8 · s) / 8 = s
    w = codes * np.float32(0.25)
    raw = gguf.quants.quantize(w, Q.Q4_0)
    got = engine_weight(torch.from_numpy(raw), Q.Q4_0, 64, "int4", torch.float32).dequantize()
    assert torch.equal(got, torch.from_numpy(gguf.quants.dequantize(raw, Q.Q4_0)))


def _random_blocks(qtype: gguf.GGMLQuantizationType, rows: int, blocks: int, scales: dict[int, np.ndarray],
                   seed: int = 0) -> np.ndarray:
    """(rows, row bytes) of random blocks of `qtype` (the gguf package reads K-quants but does not write them),
    with the floats at each byte offset of `scales` set to values drawn from that array."""
    rng = np.random.default_rng(seed)
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, size=(rows, blocks, size), dtype=np.uint8)
    for at, values in scales.items():
        drawn = rng.choice(values, size=(rows, blocks))
        raw[..., at:at + values.itemsize] = drawn[..., None].view(np.uint8).reshape(rows, blocks, values.itemsize)
    return raw.reshape(rows, -1)


def test_a_q4_k_weight_is_mapped_into_int4_without_a_float_copy(monkeypatch):
    # f16 d and dmin of a few magnitudes, the eight 6-bit scales and mins and the codes random bytes
    raw = _random_blocks(Q.Q4_K, 8, 3, {0: np.float16([0.01, 3e-4, 0.07]), 2: np.float16([0.005, 1e-3, 0.02])})
    floats: list[str] = []
    monkeypatch.setattr(gguf_blocks, "quantize", lambda *a, **k: floats.append("quantize"))
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *a, **k: floats.append("dequantize"))
    CONVERSIONS.clear()
    got = engine_weight(torch.from_numpy(raw), Q.Q4_K, 3 * 256, "int4", torch.float32)
    assert dict(CONVERSIONS) == {MAPPED: 1} and floats == []
    monkeypatch.undo()
    want = torch.from_numpy(gguf.quants.dequantize(raw, Q.Q4_K)).double()
    # the only error is the rounding of each group's scale and zero to bf16 (8 significant bits: off by at most
    # 2^-8 of the value): a weight of code q is off by at most |q - 8| times the scale's error and the zero's
    scale, zero = (t.double().repeat_interleave(32, dim=1) for t in (got.scale, got.zero))
    centred = (unpack_int4(got.codes).double() - 8).abs()
    bound = (centred * scale.abs() + zero.abs()) * 2.0**-8 * (1 + 1e-6)
    assert ((got.dequantize(torch.float64) - want).abs() <= bound).all()
    assert (got.dequantize(torch.float64) - want).abs().max() > 0  # the bf16 rounding is real, and bounded


def reference_int4(raw: torch.Tensor, qtype: gguf.GGMLQuantizationType, k: int) -> torch.Tensor:
    """A Q4_0, Q4_1 or Q4_K weight's codes in the engine's pairs as the mapping first made them, code by code: every
    code unpacked in order, then paired (what the word-wise mapping must give bit for bit)."""
    n = raw.shape[0]
    if qtype == Q.Q4_K:
        packed = raw.reshape(n, k // 256, 144)[..., 16:].reshape(n, k // 256, 4, 32)
    else:
        packed = raw.reshape(n, k // 32, -1)[..., 2 if qtype == Q.Q4_0 else 4:]
    return pack_int4(torch.cat((packed & 0xF, packed >> 4), dim=-1).reshape(n, k))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K])
def test_4_bit_blocks_map_into_the_engines_codes_word_by_word_as_code_by_code(qtype):
    raw = torch.from_numpy(_random_blocks(qtype, 6, 3, {0: np.float16([0.01, 0.002])}))
    k = 3 * gguf.GGML_QUANT_SIZES[qtype][0]
    CONVERSIONS.clear()
    got = engine_weight(raw, qtype, k, "int4", torch.float32)
    assert dict(CONVERSIONS) == {MAPPED: 1} and torch.equal(got.codes, reference_int4(raw, qtype, k))


def test_a_q8_k_weight_is_mapped_into_int8_by_rescaling_its_codes():
    # Q8_K: an f32 scale, 256 int8 codes and sums for llama.cpp's kernels; the gguf package has no reader for it
    raw = _random_blocks(Q.Q8_K, 4, 2, {0: np.float32([0.01, 0.002, 0.03])})
    blocks = raw.reshape(4, 2, -1)
    values = blocks[..., 4:260].view(np.int8) * blocks[..., :4].copy().view(np.float32)
    CONVERSIONS.clear()
    got = engine_weight(torch.from_numpy(raw), Q.Q8_K, 512, "int8", torch.float32)
    assert dict(CONVERSIONS) == {MAPPED: 1}
    want = torch.from_numpy(values.reshape(4, 512))
    assert ((got.dequantize() - want).abs() <= got.scale[:, None] / 2 + 1e-7).all()  # half a step of the row's


@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.Q5_K])
def test_k_quants_the_formats_cannot_express_are_dequantized_and_quantized_again(qtype):
    # Q6_K: 6-bit codes in sub-blocks of 16; Q5_K: 5-bit codes; int8 has one scale a row, int4 4-bit codes
    at = {Q.Q6_K: 208, Q.Q5_K: 0}[qtype]
    raw = _random_blocks(qtype, 8, 2, {at: np.float16([0.01, 0.002])})
    CONVERSIONS.clear()
    got = engine_weight(torch.from_numpy(raw), qtype, 512, "int8", torch.float32)
    want = quantize(torch.from_numpy(gguf.quants.dequantize(raw, qtype)), "int8")
    assert dict(CONVERSIONS) == {DEQUANTIZED: 1}
    assert torch.equal(got.codes, want.codes) and torch.equal(got.scale, want.scale)


def test_a_gguf_files_key_follows_its_bytes(tiny, tmp_path):
    one = write_gguf(tiny("qwen3_moe"), tmp_path / "one.gguf", experts=Q.Q4_0)
    again = model_key(one)
    (tmp_path / "two").mkdir()
    two = write_gguf(tiny("qwen3_moe"), tmp_path / "two" / "one.gguf", experts=Q.Q8_0)
    assert again == model_key(one) and again.startswith("one.gguf@") and model_key(two) != again


def test_a_gguf_files_size_counts_the_same_parameters_and_experts_as_its_checkpoint(tiny, tmp_path):
    file = write_gguf(tiny("qwen3_moe"), tmp_path / "model.gguf", experts=Q.Q4_0)
    from_file, from_folder = (model_size(checkpoint_tensors(where)) for where in (file, tiny("qwen3_moe")))
    assert (from_file.parameters, from_file.expert_parameters) == (from_folder.parameters,
                                                                    from_folder.expert_parameters)
    assert from_file.formats["int4"].expert_bytes == from_folder.formats["int4"].expert_bytes


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_0])
def test_a_qwen2_moe_gguf_with_its_shared_expert_loads_as_transformers_reads_it(tiny, tmp_path, qtype):
    file = write_gguf(tiny("qwen2_moe"), tmp_path / "qwen2moe.gguf", experts=qtype, weights=qtype)
    assert gguf.GGUFReader(file).fields["general.architecture"].contents() == "qwen2moe"
    loaded = load_model(file)
    config = loaded.model.config
    assert loaded.family == "qwen2_moe" and (config.moe_intermediate_size, config.shared_expert_intermediate_size) \
        == (32, 128)  # the widths transformers' mapping does not read, from the file
    # the shared expert's gate, a 1-D tensor in the file, as the model holds it
    assert loaded.model.model.layers[0].mlp.shared_expert_gate.weight.shape == (1, config.hidden_size)
    assert (logits(loaded.model) - reference_logits(file)).abs().max() < 1e-4


def _dequantized_mixtral(file: Path, folder: Path) -> torch.nn.Module:
    """transformers' Mixtral with every weight of the file as gguf dequantizes it, mapped by transformers' llama
    map and tensor processor: transformers' own GGUF load reads a llama file as a dense llama (its mapping has no
    expert count), so it cannot be the reference here."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    processor = LlamaTensorProcessor(config=model.config.to_dict())
    names, state = get_gguf_hf_weights_map(model, processor, model_type="llama"), model.state_dict()
    for tensor in gguf.GGUFReader(file).tensors:
        values = torch.from_numpy(processor.process(weights=gguf.quants.dequantize(tensor.data, tensor.tensor_type),
                                                    name=tensor.name).weights.copy())
        if match := re.fullmatch(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight", tensor.name):
            experts = f"model.layers.{match[1]}.mlp.experts."
            if match[2] == "down":
                state[experts + "down_proj"].copy_(values)
            else:
                state[experts + "gate_up_proj"].chunk(2, dim=1)[match[2] == "up"].copy_(values)
        else:
            state[names[tensor.name]].copy_(values.reshape(state[names[tensor.name]].shape))
    return model


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0, Q.Q4_0])
def test_mixtral_experts_stored_in_a_llama_file_load_as_a_mixtral(tiny, tmp_path, qtype):
    folder = tiny("mixtral")
    file = write_gguf(folder, tmp_path / "mixtral.gguf", experts=qtype, weights=qtype)
    fields = gguf.GGUFReader(file).fields
    assert fields["general.architecture"].contents() == "llama" and fields["llama.expert_count"].contents() == 16
    loaded = load_model(file)
    assert loaded.family == "mixtral" and loaded.model.config.num_local_experts == 16
    got = logits(loaded.model)
    assert (got - logits(_dequantized_mixtral(file, folder))).abs().max() < 1e-4
    if qtype == Q.F32:  # the file holds the checkpoint's weights exactly
        assert (got - logits(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))).abs().max() < 1e-5


def test_the_other_weights_are_dequantized_a_few_rows_at_a_time_and_laid_out_in_any_dtype(tiny_llama, tmp_path,
                                                                                         monkeypatch):
    file = write_gguf(tiny_llama, tmp_path / "llama.gguf", weights=Q.Q8_0)
    whole = gguf_model(file, torch.float32, experts_implementation="eager")
    rows: list[int] = []
    dequantized = gguf_load.dequantized
    monkeypatch.setattr(gguf_load, "dequantized", lambda raw, kind: rows.append(len(raw)) or dequantized(raw, kind))
    monkeypatch.setattr(gguf_load, "_FLOAT_VALUES_AT_ONCE", 4 * 64)  # four rows of the hidden width
    in_rows = gguf_model(file, torch.float32, experts_implementation="eager")
    assert max(rows) == 4 and len(rows) > len(list(whole.parameters()))  # every 2-D weight in several reads
    assert torch.equal(logits(in_rows), logits(whole))
    # llama's permuted query and key rows, laid out on the bits: bf16 holds the float32 load's values rounded
    half = gguf_model(file, torch.bfloat16, experts_implementation="eager")
    for name in ("q_proj", "k_proj"):
        got = getattr(half.model.layers[0].self_attn, name).weight
        assert torch.equal(got, getattr(whole.model.layers[0].self_attn, name).weight.to(torch.bfloat16))


def test_a_gpt_oss_gguf_is_refused_with_the_reason_before_anything_is_read(tmp_path):
    file = tmp_path / "gpt-oss.gguf"
    writer = gguf.GGUFWriter(file, "gpt-oss")  # llama.cpp's name for it
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelError, match=r"'gpt-oss' is not one the engine reads.*registered as 'gpt_oss'"):
        load_model(file)
