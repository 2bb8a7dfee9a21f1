"""The streaming loader: the same model as transformers' from_pretrained, experts packed as they are read, the
quantized experts `npumoed model quantize` wrote taken as they are, and from_pretrained where it cannot read."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from npumoe.engine import Engine, EngineSettings
from npumoe.engine.attach.runtime import MoeRuntime
from npumoe.engine.backends.registry import get_backend
from npumoe.engine.loading import load, stream_load
from npumoe.engine.loading.load import load_model
from npumoe.engine.loading.model_size import checkpoint_tensors, model_size
from npumoe.engine.loading.quant_store import QuantizedReader, quantize_checkpoint, quantized_folder
from npumoe.engine.loading.resolve import fingerprint
from npumoe.engine.moe.model_experts import moe_experts
from npumoe.engine.synthetic.byte_tokenizer import build_byte_tokenizer
from npumoe.engine.synthetic.geometry import family_config, parse_geometry

linux = pytest.mark.skipif(sys.platform != "linux", reason="reads the peak from Linux's /proc")

# per-expert tensors stacked by transformers' converters (Qwen's gate/up/down, DeepSeek's, Mixtral's w1/w3/w2),
# a fused checkpoint renamed into the model's names (GraniteMoE), and fused, transposed, interleaved experts
# with biases whose checkpoint names are the model's own (gpt-oss)
FAMILIES = ["qwen3_moe", "mixtral", "deepseek_v2", "granitemoe", "gpt_oss"]
IDS = torch.arange(3, 60)[None]


@pytest.fixture
def streamed_calls(monkeypatch) -> list[str]:
    """The checkpoints stream_model read (so a test knows the streaming path ran, not the fallback)."""
    calls: list[str] = []
    original = stream_load.stream_model

    def counting(path: Path, *args, **kwargs):
        model = original(path, *args, **kwargs)
        calls.append(path.name)
        return model

    monkeypatch.setattr(load, "stream_model", counting)  # where load_model calls it
    return calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_a_streamed_model_is_the_one_from_pretrained_makes(tiny, streamed_calls, arch, dtype):
    folder = tiny(arch)
    loaded = load_model(folder, dtype=dtype)
    assert loaded.streamed and streamed_calls == [folder.name]
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=loaded.model.dtype,
                                                     experts_implementation="eager").eval()
    got, want = loaded.model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
    assert all(not p.is_meta for p in loaded.model.parameters())
    with torch.inference_mode():
        assert torch.equal(loaded.model(IDS).logits, reference(IDS).logits)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return model(IDS).logits


@pytest.mark.parametrize("format", [None, "int8", "int4"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_experts_packed_as_they_are_read_run_as_those_packed_after_loading(tiny, packed_at_load, arch, format):
    folder = tiny(arch)
    dtype = "float32" if format is None else "bfloat16"
    after = load_model(folder, dtype=dtype).model
    MoeRuntime(after, get_backend("cpu"), quantized=format, release=True)
    loaded = load_model(folder, dtype=dtype, pack=True, format=format)
    modules = [module for _, module in moe_experts(loaded.model)]
    assert loaded.streamed and len(packed_at_load) == len(modules)
    runtime = MoeRuntime(loaded.model, get_backend("cpu"), quantized=format, release=True)
    # the runtime runs the experts packed while reading, not a copy made after
    assert [layer.experts for layer in runtime.layers] == packed_at_load
    assert all(module._npumoe_owned is experts for module, experts in zip(modules, packed_at_load, strict=True))
    assert torch.equal(_logits(loaded.model), _logits(after))


@pytest.fixture(scope="module")
def bf16_checkpoint(tiny, tmp_path_factory) -> Path:
    """The tiny Qwen3-MoE saved in bf16: quantizing it from the file or after loading it in bf16 starts from the
    same values."""
    folder = tmp_path_factory.mktemp("bf16") / "model"
    AutoModelForCausalLM.from_pretrained(tiny("qwen3_moe"), dtype=torch.bfloat16).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny("qwen3_moe")).save_pretrained(folder)
    return folder


def quantized_home(checkpoint: Path, tmp_path: Path, format: str) -> Path:
    """A home's models folder holding `npumoed model quantize`'s files of `checkpoint` in `format`."""
    models = tmp_path / "models"
    quantize_checkpoint(checkpoint, quantized_folder(models, checkpoint, fingerprint(checkpoint), format), format)
    return models


@pytest.mark.parametrize("format", ["int8", "int4"])
def test_experts_quantized_once_are_read_at_load_not_quantized_again(bf16_checkpoint, tmp_path, monkeypatch, format):
    models = quantized_home(bf16_checkpoint, tmp_path, format)
    read: list[str] = []
    weight = QuantizedReader.weight
    monkeypatch.setattr(QuantizedReader, "weight", lambda self, name: read.append(name) or weight(self, name))

    loaded = load_model(bf16_checkpoint, dtype="bfloat16", pack=True, format=format, models_dir=models)
    experts = len(moe_experts(loaded.model))
    assert loaded.streamed and len(read) == experts * loaded.model.config.num_experts * 3  # gate, up, down each
    MoeRuntime(loaded.model, get_backend("cpu"), quantized=format, release=True)
    after = load_model(bf16_checkpoint, dtype="bfloat16").model
    MoeRuntime(after, get_backend("cpu"), quantized=format, release=True)
    assert torch.equal(_logits(loaded.model), _logits(after))


def test_the_engine_reads_the_homes_quantized_experts_and_runs_them_as_packed(bf16_checkpoint, tmp_path,
                                                                             monkeypatch):
    models = quantized_home(bf16_checkpoint, tmp_path, "int4")
    read: list[str] = []
    weight = QuantizedReader.weight
    monkeypatch.setattr(QuantizedReader, "weight", lambda self, name: read.append(name) or weight(self, name))
    engine = Engine.load(EngineSettings(model=str(bf16_checkpoint), weights="int4", models_dir=models))
    assert engine.loaded.streamed and read
    assert all(module._npumoe_owned is layer.experts
               for (_, module), layer in zip(moe_experts(engine.loaded.model), engine.runtime.layers, strict=True))
    assert {layer.experts.format for layer in engine.runtime.layers} == {"int4"}


def test_without_quantized_files_for_this_format_the_experts_are_quantized_at_load(bf16_checkpoint, tmp_path,
                                                                                   monkeypatch):
    models = quantized_home(bf16_checkpoint, tmp_path, "int8")
    read: list[str] = []
    monkeypatch.setattr(QuantizedReader, "weight", lambda self, name: read.append(name))
    assert load_model(bf16_checkpoint, dtype="bfloat16", pack=True, format="int4", models_dir=models).streamed
    assert read == []


def test_a_checkpoint_the_loader_cannot_map_is_loaded_by_from_pretrained_and_the_log_says_why(tiny, caplog,
                                                                                             streamed_calls):
    folder = tiny("deepseek_v4")  # its saved names need transformers' reverse renaming, which the loader lacks
    with caplog.at_level(logging.INFO, logger="npumoe.engine.loading.load"):
        loaded = load_model(folder)
    assert not loaded.streamed and streamed_calls == []
    assert "not streamed tensor by tensor" in caplog.text and "not in the checkpoint" in caplog.text
    reference = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager").eval()
    assert torch.equal(_logits(loaded.model), _logits(reference))


# The child notes its resident memory once everything is imported, loads the checkpoint packing its experts, and
# prints its high-water mark over that: Linux's VmHWM, in kilobytes (ru_maxrss would keep this test's own peak,
# inherited across exec).
_CHILD = textwrap.dedent("""
    import json, sys
    import psutil, torch
    from npumoe.engine.loading.load import load_model
    torch.set_num_threads(1)
    before = psutil.Process().memory_info().rss
    loaded = load_model(sys.argv[1], dtype="bfloat16", pack=True)
    peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    print(json.dumps({"streamed": loaded.streamed, "peak_over_before": peak - before}))
""")


@pytest.fixture(scope="module")
def real_sized_checkpoint(tmp_path_factory) -> Path:
    """Two Qwen3-MoE layers at Qwen3-30B-A3B's expert sizes (hidden 2048, expert FFN 768) with 16 of its 128
    experts and a small vocabulary, in bf16 (about 340 MB, nearly all experts)."""
    folder = tmp_path_factory.mktemp("real-sized") / "model"
    config = family_config(parse_geometry("2048x16x4x768"), layers=2, vocab_size=512, num_attention_heads=8,
                           num_key_value_heads=2, head_dim=64)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    build_byte_tokenizer().save_pretrained(folder)
    return folder


# What loading costs beside the weights that does not grow with them: library code first run while loading
# (about 20 MiB of file pages), the model's modules, a few experts read ahead of packing.
_FIXED = 64 * 2**20


@linux
def test_loading_peaks_at_little_more_than_the_weights(real_sized_checkpoint):
    """from_pretrained then packing held the experts twice (about 2x); streamed, the peak is one copy and a little.
    The quantized formats' peaks are measured at full size by `npumoed bench memory`."""
    done = subprocess.run([sys.executable, "-c", _CHILD, str(real_sized_checkpoint)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    weights = model_size(checkpoint_tensors(real_sized_checkpoint)).formats["bf16"].total_bytes
    assert result["streamed"]
    assert result["peak_over_before"] <= 1.15 * weights + _FIXED, result["peak_over_before"] / weights
