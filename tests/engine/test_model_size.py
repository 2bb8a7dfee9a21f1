"""`npumoed model size` (memory per weight format, from headers or a config alone) and `npumoed model quantize`."""

from __future__ import annotations

import json
import math
import struct
from collections import namedtuple
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner
from safetensors import safe_open

from npumoe.daemon.cli.engine import model_group
from npumoe.engine.loading.model_size import needed_bytes, usable_bytes
from npumoe.engine.loading.quant_store import load_quantized
from npumoe.engine.loading.resolve import fingerprint

pytestmark = pytest.mark.usefixtures("home")

# Qwen3-30B-A3B's published config.json (Qwen/Qwen3-30B-A3B-Instruct-2507), the sizes that count.
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936,
                 "tie_word_embeddings": False}


def invoke(*args: object):
    return CliRunner().invoke(model_group, [str(a) for a in args], catch_exceptions=False)


def sizes(*args: object) -> dict:
    done = invoke("size", *args, "--json")
    assert done.exit_code == 0, done.output
    return json.loads(done.output)


def test_a_checkpoints_sizes_are_its_tensors_counted_in_each_format(tiny_model):
    numel = {"experts": 0, "expert rows": 0, "other": 0}
    with safe_open(str(tiny_model / "model.safetensors"), "pt") as reader:
        for name in reader.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
            shape = reader.get_slice(name).get_shape()
            count = math.prod(shape)
            if ".mlp.experts." in name:
                numel["experts"] += count
                numel["expert rows"] += shape[0]
            else:
                numel["other"] += count
    data = sizes(tiny_model)
    by_format = {row["format"]: row for row in data["formats"]}
    assert data["parameters"] == numel["experts"] + numel["other"] and data["expert_parameters"] == numel["experts"]
    assert by_format["fp32"]["weight_bytes"] == 4 * data["parameters"]
    assert by_format["bf16"]["weight_bytes"] == 2 * data["parameters"]
    assert by_format["int8"]["expert_bytes"] == numel["experts"] + 4 * numel["expert rows"]
    assert by_format["int4"]["expert_bytes"] == numel["experts"] // 2 + numel["experts"] // 32 * 4
    assert by_format["int4"]["other_bytes"] == 2 * numel["other"]
    assert all(row["needed_bytes"] == needed_bytes(row["weight_bytes"]) for row in data["formats"])


def test_no_weight_is_read_only_the_headers(tmp_path):
    """A checkpoint whose files hold headers and no data at all is counted all the same."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    header = {"model.layers.0.mlp.experts.0.gate_proj.weight": {"dtype": "BF16", "shape": [768, 2048],
                                                                "data_offsets": [0, 768 * 2048 * 2]},
              "model.embed_tokens.weight": {"dtype": "BF16", "shape": [151936, 2048],
                                            "data_offsets": [768 * 2048 * 2, 768 * 2048 * 2 + 151936 * 2048 * 2]}}
    encoded = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(encoded)) + encoded)
    data = sizes(tmp_path)
    assert data["parameters"] == 768 * 2048 + 151936 * 2048 and data["expert_parameters"] == 768 * 2048


Memory = namedtuple("Memory", "total")


@pytest.mark.parametrize(("ram_gib", "fitting"), [(16, []), (32, ["int4"]), (64, ["int8", "int4"]),
                                                  (128, ["bf16", "int8", "int4"])])
def test_a_published_config_alone_gives_the_sizes_and_what_fits_this_machine(tmp_path, monkeypatch, ram_gib, fitting):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN3_30B_A3B))
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory(ram_gib * 2**30))
    data = sizes(config)
    assert abs(data["parameters"] / 1e9 - 30.5) < 0.1  # the model card's 30.5 B
    by_format = {row["format"]: row for row in data["formats"]}
    assert by_format["int4"]["weight_bytes"] < 0.36 * by_format["bf16"]["weight_bytes"]
    assert data["usable_bytes"] == usable_bytes(ram_gib * 2**30)
    assert [row["format"] for row in data["formats"] if row["fits"]] == fitting
    shown = invoke("size", config)
    assert "30.5 B parameters" in " ".join(shown.output.split()) and "fits here" in shown.output


@pytest.mark.parametrize(("what", "message"), [("missing", "does not exist"), ("no type", "no model_type")])
def test_what_cannot_be_sized_is_a_clear_error(tmp_path, what, message):
    target = tmp_path / "nothing"
    if what == "no type":
        target = tmp_path / "config.json"
        target.write_text(json.dumps({"hidden_size": 8}))
    done = invoke("size", target)
    assert done.exit_code != 0 and message in done.output


def test_quantize_writes_the_experts_into_the_homes_models_folder(tiny_model, home):
    done = invoke("quantize", tiny_model, "--weights", "int4")
    assert done.exit_code == 0, done.output
    folder = home / "models" / "quantized" / f"{tiny_model.name}-{fingerprint(tiny_model)}" / "int4"
    assert str(folder) in done.output.replace("\n", "")
    experts = load_quantized(folder)
    assert experts.format == "int4" and experts.source == Path(tiny_model).resolve() and experts.weights
    refused = invoke("quantize", tiny_model, "--weights", "int2")
    assert refused.exit_code != 0 and "int2" in refused.output
