"""gpt-oss checkpoints whose experts are stored in MXFP4: streamed expert by expert, dequantized as transformers
does, packed as they are read; counted by `model size` at the size they dequantize to."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from npumoe.engine.attach.runtime import MoeRuntime
from npumoe.engine.backends.registry import get_backend
from npumoe.engine.formats.mxfp4 import dequantize_expert
from npumoe.engine.loading import stream_load
from npumoe.engine.loading.auto_weights import expert_sizes
from npumoe.engine.loading.load import load_model
from npumoe.engine.loading.model_size import checkpoint_tensors, config_tensors, model_size
from npumoe.engine.moe.model_experts import moe_experts

IDS = torch.arange(3, 60)[None]
# gpt-oss's own: attention, routers, embeddings and the head stay bf16
QUANTIZATION = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def write_mxfp4(float_checkpoint: Path, out: Path, quantization: dict) -> Path:
    """`float_checkpoint` (a tiny gpt-oss) as gpt-oss ships: its experts as random MXFP4 blocks with scales of
    2^-6 to 2^-2 (weights up to ±1.5), everything else bf16."""
    shutil.copytree(float_checkpoint, out)
    generator = torch.Generator().manual_seed(1)
    stored = {}
    for name, tensor in load_file(float_checkpoint / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, k, n = tensor.shape  # (E, in, out) as gpt-oss's module holds them
            stored[f"{name}_blocks"] = torch.randint(0, 256, (experts, n, k // 32, 16), dtype=torch.uint8,
                                                     generator=generator)
            stored[f"{name}_scales"] = torch.randint(121, 126, (experts, n, k // 32), dtype=torch.uint8,
                                                     generator=generator)
        else:
            stored[name] = tensor.to(torch.bfloat16)
    save_file(stored, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    return out


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tiny, tmp_path_factory) -> Path:
    return write_mxfp4(tiny("gpt_oss"), tmp_path_factory.mktemp("mxfp4") / "model", QUANTIZATION)


@pytest.fixture
def dequantized(monkeypatch) -> list[tuple[int, ...]]:
    """The shape of every expert the streaming loader dequantized (so a test knows it, not the fallback, ran)."""
    calls: list[tuple[int, ...]] = []

    def counting(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        calls.append(tuple(blocks.shape))
        return dequantize_expert(blocks, scales, dtype)

    monkeypatch.setattr(stream_load, "dequantize_expert", counting)
    return calls


def reference(folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' own load of the checkpoint, its experts dequantized (as it does on a CPU)."""
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, experts_implementation="eager",
                                                quantization_config=Mxfp4Config(dequantize=True)).eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return model(IDS).logits


def _expert_count(folder: Path) -> int:
    """Experts of all layers, each read once per projection (gate-up, down)."""
    config = AutoConfig.from_pretrained(folder)
    return config.num_hidden_layers * config.num_local_experts * 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_streamed_mxfp4_model_is_the_one_from_pretrained_dequantizes(mxfp4_checkpoint, dequantized, dtype):
    loaded = load_model(mxfp4_checkpoint, dtype=dtype)
    assert loaded.streamed and len(dequantized) == _expert_count(mxfp4_checkpoint)
    want = reference(mxfp4_checkpoint, loaded.model.dtype)
    got, expected = loaded.model.state_dict(), want.state_dict()
    assert got.keys() == expected.keys()
    assert all(got[k].dtype == expected[k].dtype and torch.equal(got[k], expected[k]) for k in expected)
    assert torch.equal(_logits(loaded.model), _logits(want))


@pytest.mark.parametrize("format", [None, "int8", "int4"])
def test_mxfp4_experts_packed_as_they_are_read_run_as_those_quantized_after_loading(mxfp4_checkpoint, dequantized,
                                                                                  packed_at_load, format):
    dtype = torch.float32 if format is None else torch.bfloat16
    after = reference(mxfp4_checkpoint, dtype)
    MoeRuntime(after, get_backend("cpu"), quantized=format, release=True)
    loaded = load_model(mxfp4_checkpoint, dtype=str(dtype).removeprefix("torch."), pack=True, format=format)
    modules = [module for _, module in moe_experts(loaded.model)]
    assert loaded.streamed and len(packed_at_load) == len(modules)
    assert len(dequantized) == _expert_count(mxfp4_checkpoint)
    runtime = MoeRuntime(loaded.model, get_backend("cpu"), quantized=format, release=True)
    assert [layer.experts for layer in runtime.layers] == packed_at_load
    assert {layer.experts.format for layer in runtime.layers} == {format}
    assert torch.equal(_logits(loaded.model), _logits(after))


def test_one_expert_dequantizes_as_transformers_does_the_whole_tensor():
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(120, 134, (3, 8, 2), dtype=torch.uint8, generator=generator)
    whole = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert all(torch.equal(dequantize_expert(blocks[e], scales[e], torch.float32), whole[e]) for e in range(3))
    # the low nibble first, E2M1 (1: 0.5, 2: 1.0, 0xF: -6), times 2^(scale - 127), each expert (in, out)
    byte = torch.zeros(1, 1, 16, dtype=torch.uint8)
    byte[0, 0, 0] = 0xF1
    one = dequantize_expert(byte, torch.tensor([[128]], dtype=torch.uint8), torch.float32)
    assert one.shape == (32, 1) and one[:2, 0].tolist() == [1.0, -12.0] and not one[2:].any()


def test_blocks_and_scales_that_do_not_match_are_a_clear_error():
    with pytest.raises(ValueError, match="uint8"):
        dequantize_expert(torch.zeros(8, 2, 16, dtype=torch.uint8), torch.zeros(8, 3, dtype=torch.uint8),
                          torch.float32)


def test_mxfp4_blocks_without_their_scales_are_not_streamed(mxfp4_checkpoint, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(mxfp4_checkpoint, folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, folder / "model.safetensors")
    config = AutoConfig.from_pretrained(folder)
    with pytest.raises(stream_load.NotStreamable, match=r"layers\.1\.mlp\.experts\.down_proj has blocks but not both"):
        stream_load.stream_model(folder, config, torch.bfloat16, experts_implementation="eager")


class _FellBack(Exception):
    pass


def test_another_quantization_method_falls_back_to_from_pretrained_and_says_which(mxfp4_checkpoint, tmp_path,
                                                                                  dequantized, monkeypatch, caplog):
    folder = tmp_path / "model"
    shutil.copytree(mxfp4_checkpoint, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps(config))
    asked: list[Path] = []

    def from_pretrained(path: Path, **settings: object) -> None:  # transformers' fp8 needs a GPU: only note the call
        asked.append(path)
        raise _FellBack

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    with caplog.at_level(logging.INFO, logger="npumoe.engine.loading.load"), pytest.raises(_FellBack):
        load_model(folder)
    assert asked == [folder] and dequantized == []
    assert "not streamed tensor by tensor" in caplog.text and "stored quantized (fp8)" in caplog.text


def test_mxfp4_experts_count_at_the_size_they_dequantize_to(mxfp4_checkpoint):
    tensors = checkpoint_tensors(mxfp4_checkpoint)
    config = json.loads((mxfp4_checkpoint / "config.json").read_text())
    from_config = config_tensors({k: v for k, v in config.items() if k != "quantization_config"})
    assert model_size(tensors) == model_size(from_config)
    assert sum(t.numel for t in tensors) == sum(p.numel() for p in reference(mxfp4_checkpoint,
                                                                             torch.bfloat16).parameters())
    experts = {t.name: t.shape for t in tensors if t.expert}
    # (E, out, in): the gate-up projection's 2·I rows of H, the down projection's H rows of I
    assert experts["model.layers.0.mlp.experts.gate_up_proj"] == (16, 64, 64)
    assert experts["model.layers.0.mlp.experts.down_proj"] == (16, 64, 32)
    assert len(experts) == 6 and expert_sizes(mxfp4_checkpoint) == (64, 32)
