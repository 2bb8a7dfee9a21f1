"""Quantized experts written from a checkpoint one tensor at a time, within a memory limit, and read back mapped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from npumoe.engine.formats.quantize import INT4, INT8, relative_error
from npumoe.engine.loading import quant_store
from npumoe.engine.loading.quant_store import QuantizedStoreError, load_quantized, quantize_checkpoint
from npumoe.engine.synthetic.geometry import family_config, parse_geometry

# RLIMIT_AS and /proc are Linux's; macOS neither enforces the one nor has the other.
linux = pytest.mark.skipif(sys.platform != "linux", reason="needs Linux's RLIMIT_AS and /proc")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """Two Qwen3-MoE layers at Qwen3-30B-A3B's expert sizes (hidden 2048, expert FFN 768) with 16 of its 128
    experts, float32 (about 640 MB), in the shards save_pretrained makes (100 MB at most here)."""
    folder = tmp_path_factory.mktemp("checkpoint")
    config = family_config(parse_geometry("2048x16x4x768"), layers=2, vocab_size=512, num_attention_heads=8,
                           num_key_value_heads=2, head_dim=64)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder, max_shard_size="40MB")
    return folder


# The child quantizes with address space for its interpreter and libraries (measured once they are loaded)
# plus a headroom well under the checkpoint's size, so it cannot hold the checkpoint (it first shows that it
# cannot allocate that much), only a mapped shard (safe_open maps it twice while opening) and the tensor at hand.
_CHILD = textwrap.dedent("""
    import json, resource, sys
    from pathlib import Path
    import torch
    from npumoe.engine.loading.quant_store import quantize_checkpoint
    torch.set_num_threads(1)
    source, target, format, headroom, checkpoint_bytes = sys.argv[1:]
    mapped = int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmSize:"))) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mapped + int(headroom), mapped + int(headroom)))
    try:
        torch.empty(int(checkpoint_bytes), dtype=torch.uint8)
        refused = False
    except (RuntimeError, MemoryError):
        refused = True
    report = quantize_checkpoint(Path(source), Path(target), format)
    print(json.dumps({"refused": refused, "experts": report.experts}))
""")


@linux
@pytest.mark.parametrize("format", [INT4, pytest.param(INT8, marks=pytest.mark.slow)])
def test_a_checkpoint_is_quantized_within_less_memory_than_it_takes(checkpoint, tmp_path, format):
    shards = [path.stat().st_size for path in checkpoint.glob("*.safetensors")]
    size = sum(shards)
    headroom = 2 * max(shards) + 60 * 2**20  # a shard mapped, a float32 expert tensor and its codes, and spare
    assert len(shards) > 1 and headroom < 0.5 * size
    environment = {**os.environ, "MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _CHILD, str(checkpoint), str(tmp_path / "q"), format,
                           str(headroom), str(size)], capture_output=True, text=True, env=environment, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"refused": True, "experts": 2 * 16 * 3}
    experts = load_quantized(tmp_path / "q")
    assert len(experts.weights) == 96 and experts.format == format
    name = "model.layers.0.mlp.experts.7.down_proj.weight"
    shard = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"][name]
    with safe_open(str(checkpoint / shard), "pt") as reader:
        original = reader.get_tensor(name)
    assert relative_error(experts.weights[name].dequantize(), original) < (0.01 if format == INT8 else 0.1)


@linux
def test_loaded_experts_are_mapped_from_the_files_not_copied(checkpoint, tmp_path):
    quantize_checkpoint(checkpoint, tmp_path / "q", INT8)
    experts = load_quantized(tmp_path / "q")
    codes = next(iter(experts.weights.values())).codes
    assert not codes.untyped_storage().resizable()  # a view of the memory map, which torch cannot resize
    mapped = {line.split()[-1] for line in Path(f"/proc/{os.getpid()}/maps").read_text().splitlines()
              if len(line.split()) >= 6}
    assert {str(path) for path in (tmp_path / "q").glob("*.safetensors")} <= mapped


def test_only_expert_weights_are_written_and_the_rest_is_left_in_the_checkpoint(checkpoint, tmp_path):
    calls: list[str] = []
    report = quantize_checkpoint(checkpoint, tmp_path / "q", INT4, progress=lambda done, total: calls.append(done))
    assert calls == list(range(1, 97)) and report.experts == 96 and report.kept > 0
    manifest = json.loads((tmp_path / "q" / quant_store.MANIFEST).read_text())
    written = {name for names in manifest["files"].values() for name in names}
    assert len(written) == 96 and all(".mlp.experts." in name for name in written)
    assert report.quantized_bytes < report.source_bytes * 5 / 32 * 1.01  # 5 bits a weight against 32


def test_experts_of_weights_that_changed_since_are_refused(tmp_path):
    from npumoe.engine.synthetic.tiny import make_tiny

    make_tiny("qwen3_moe", tmp_path / "m", seed=0)
    quantize_checkpoint(tmp_path / "m", tmp_path / "q", INT8)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "rope_theta": 1.0}))
    with pytest.raises(QuantizedStoreError, match="made from other weights"):
        load_quantized(tmp_path / "q")


def test_a_folder_without_experts_is_a_clear_error(tmp_path):
    with pytest.raises(QuantizedStoreError, match="no safetensors files"):
        quantize_checkpoint(tmp_path, tmp_path / "q", INT8)
    with pytest.raises(QuantizedStoreError, match="no readable quantized experts"):
        load_quantized(tmp_path)
