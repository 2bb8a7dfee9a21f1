"""GGUF files through the engine's choices and commands: `auto` never widens a quantized file, `model quantize`
writes its experts into the home and a load takes them from there, `calibrate` takes a GGUF model."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import gguf
import pytest
import torch
from click.testing import CliRunner

from npumoe.daemon.cli.engine import calibrate_command, model_group
from npumoe.engine.attach.runtime import MoeRuntime
from npumoe.engine.backends.registry import get_backend
from npumoe.engine.formats.gguf_blocks import CONVERSIONS, stored_format
from npumoe.engine.kernels import choice as mechanism
from npumoe.engine.loading import auto_weights, gguf_load, quant_store
from npumoe.engine.loading.auto_weights import choose_weights
from npumoe.engine.loading.gguf_load import experts_format
from npumoe.engine.loading.load import load_model
from npumoe.engine.loading.model_size import MIN_RESERVE_BYTES, checkpoint_tensors, model_size, needed_bytes
from npumoe.engine.loading.quant_store import quantized_folder
from npumoe.engine.loading.resolve import fingerprint
from npumoe.engine.moe.model_experts import moe_experts
from npumoe.engine.synthetic.gguf_writer import write_gguf

PLENTY = 2**40
Q = gguf.GGMLQuantizationType
IDS = torch.arange(3, 60)[None]


@pytest.fixture
def timed(tmp_path, monkeypatch) -> list[tuple[int, int]]:
    """The float timings auto makes (none cached: a fresh cache and process), counted."""
    monkeypatch.setenv("NPUMOE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(mechanism, "_chosen", {})
    calls: list[tuple[int, int]] = []

    def seconds(hidden: int, ffn: int, dtype: torch.dtype) -> float:
        calls.append((hidden, ffn))
        return 1e-3 if dtype.itemsize == 2 else 2e-3

    monkeypatch.setattr(auto_weights, "expert_seconds", seconds)
    return calls


def test_each_block_type_loads_into_the_narrowest_format_that_does_not_widen_it():
    assert {t: stored_format(getattr(Q, t)) for t in ("F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_0", "Q4_1", "Q4_0",
                                                      "Q4_K", "Q2_K", "MXFP4")} == {
        "F32": None, "F16": None, "BF16": None, "Q8_0": "int8", "Q6_K": "int8", "Q5_0": "int8", "Q4_1": "int4",
        "Q4_0": "int4", "Q4_K": "int4", "Q2_K": "int4", "MXFP4": "int4"}


@pytest.mark.parametrize(("type_name", "format"), [("Q8_0", "int8"), ("Q4_0", "int4"), ("Q4_1", "int4")])
def test_auto_keeps_a_quantized_files_experts_in_their_format_and_times_no_float_kernel(tiny_gguf, timed,
                                                                                       type_name, format):
    choice = choose_weights(tiny_gguf("qwen3_moe", type_name), PLENTY)  # room for bf16 and to spare
    assert choice.weights == format and choice.fits and "never a float format" in choice.reason
    assert timed == []  # no float dtype was considered


@pytest.mark.parametrize(("file_type", "format"), [(gguf.LlamaFileType.MOSTLY_Q4_K_M, "int4"),
                                                     (gguf.LlamaFileType.MOSTLY_Q5_K_M, "int8"), (None, "int8")])
def test_auto_reads_a_files_type_not_the_wider_blocks_llama_cpp_fell_back_to(tiny, tmp_path, timed, file_type,
                                                                             format):
    # llama-quantize stores a weight whose rows are not whole super-blocks of 256 (all of the tiny model's) in Q5_0
    # for Q4_K_M: such a file is 4-bit all the same, and loads into int4, not widened to int8
    file = write_gguf(tiny("qwen3_moe"), tmp_path / "model.gguf", experts=Q.Q5_0, weights=Q.Q5_0, file_type=file_type)
    assert experts_format(file) == format
    choice = choose_weights(file, PLENTY)
    assert choice.weights == format and f"{format} holds them without widening" in choice.reason
    assert timed == []


def test_auto_goes_down_to_int4_when_a_q8_0_files_int8_does_not_fit(tiny_gguf, timed):
    file = tiny_gguf("qwen3_moe", "Q8_0")
    int8 = needed_bytes(model_size(checkpoint_tensors(file)).formats["int8"].total_bytes)
    short = choose_weights(file, MIN_RESERVE_BYTES + int8 - 1)
    assert short.weights == "int4" and short.fits and "but int8 needs" in short.reason
    assert choose_weights(file, MIN_RESERVE_BYTES + int8).weights == "int8"
    assert not choose_weights(file, MIN_RESERVE_BYTES).fits


def test_auto_on_a_float_file_measures_the_float_kernels_at_the_files_expert_sizes(tiny_gguf, timed):
    file = tiny_gguf("qwen3_moe", "F16")
    assert experts_format(file) is None
    assert choose_weights(file, PLENTY).weights == "bf16"  # the faster dtype the spy reports
    assert timed == [(64, 32), (64, 32)]  # hidden 64, expert FFN 32: the width read from the file's metadata


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return model(IDS).logits


def _packed_logits(file: Path, format: str, models_dir: Path | None) -> torch.Tensor:
    loaded = load_model(file, dtype="float32", pack=True, format=format, models_dir=models_dir)
    MoeRuntime(loaded.model, get_backend("cpu"), quantized=format, release=True)
    return _logits(loaded.model)


def test_model_quantize_writes_a_gguf_files_experts_once_and_a_load_takes_them_from_the_home(tiny_gguf, tmp_path,
                                                                                            monkeypatch, caplog):
    file = tiny_gguf("qwen3_moe", "F16")  # float experts: each load would quantize them again
    home = tmp_path / "home"
    monkeypatch.setenv("NPUMOED_HOME", str(home))
    result = CliRunner().invoke(model_group, ["quantize", str(file), "--weights", "int4", "--json"])
    assert result.exit_code == 0, result.output
    models = home / "models"
    target = quantized_folder(models, file, fingerprint(file), "int4")
    report = json.loads(result.stdout)
    manifest = json.loads((target / quant_store.MANIFEST).read_text())
    loaded = load_model(file)
    experts = len(moe_experts(loaded.model)) * loaded.model.config.num_experts
    assert manifest["source"] == str(file.resolve()) and manifest["fingerprint"] == fingerprint(file)
    assert sum(map(len, manifest["files"].values())) == 3 * experts  # gate, up and down of every expert
    assert report["experts"] == 3 * experts and report["target"] == str(target) and report["format"] == "int4"
    assert 0 < report["quantized_bytes"] < report["source_bytes"]  # int4 from F16

    read: list[str] = []
    weight = quant_store.QuantizedReader.weight
    monkeypatch.setattr(quant_store.QuantizedReader, "weight",
                        lambda self, name: read.append(name) or weight(self, name))
    CONVERSIONS.clear()
    caplog.set_level(logging.INFO, logger=gguf_load.log.name)
    from_store = _packed_logits(file, "int4", models)
    assert len(read) == 3 * experts and not CONVERSIONS  # every expert from the store, none converted at load
    assert "converted" not in caplog.text
    # the store holds what the load would have made from the file, a load whose log says what converting cost
    assert torch.equal(from_store, _packed_logits(file, "int4", None)) and CONVERSIONS
    assert f"{file.name}: experts converted into int4 as they were read: {3 * experts} from float in " in caplog.text


@pytest.mark.parametrize(("qtype", "format"), [("Q4_0", "int4"), ("Q8_0", "int8")])
def test_a_first_load_keeps_the_experts_it_converts_and_the_second_load_converts_nothing(tiny_gguf, tmp_path,
                                                                                        caplog, qtype, format):
    file = tiny_gguf("qwen3_moe", qtype)
    models = tmp_path / "models"
    target = quantized_folder(models, file, fingerprint(file), format)
    CONVERSIONS.clear()
    caplog.set_level(logging.INFO, logger=gguf_load.log.name)
    first = _packed_logits(file, format, models)
    converted = sum(CONVERSIONS.values())
    assert converted and f"kept converted in {target}: the next load converts nothing" in caplog.text
    manifest = json.loads((target / quant_store.MANIFEST).read_text())
    assert sum(map(len, manifest["files"].values())) == converted  # every weight converted is kept
    assert [p.name for p in target.parent.iterdir()] == [format]  # renamed into place: no temporary folder left
    CONVERSIONS.clear()
    assert torch.equal(_packed_logits(file, format, models), first) and not CONVERSIONS


def test_a_load_that_fails_keeps_no_experts(tiny_gguf, tmp_path, monkeypatch):
    file = tiny_gguf("qwen3_moe", "Q4_0")
    models = tmp_path / "models"
    # the load fails once its first experts are converted and written
    monkeypatch.setattr(gguf_load.CpuExperts, "streamed",
                        classmethod(lambda cls, experts, *_, **__: [*experts] and 1 / 0))
    with pytest.raises(ZeroDivisionError):
        load_model(file, dtype="float32", pack=True, format="int4", models_dir=models)
    assert not any(models.rglob("*.safetensors")) and not any(models.rglob(quant_store.MANIFEST))


def test_a_load_whose_store_the_disk_refuses_goes_on_and_keeps_nothing(tiny_gguf, tmp_path, monkeypatch, caplog):
    file = tiny_gguf("qwen3_moe", "Q4_0")
    models = tmp_path / "models"
    writes: list[str] = []

    def full(self, name, tensor):
        writes.append(name)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(quant_store._SafetensorsWriter, "write", full)
    caplog.set_level(logging.INFO, logger=gguf_load.log.name)
    CONVERSIONS.clear()
    loaded = load_model(file, dtype="float32", pack=True, format="int4", models_dir=models)
    experts = len(moe_experts(loaded.model)) * loaded.model.config.num_experts
    assert CONVERSIONS["mapped"] == 3 * experts and len(writes) == 1  # every expert loaded, one write tried
    assert "not kept (" in caplog.text and "keeps them converted" in caplog.text  # the log says how to keep them
    assert not any(models.rglob("*.safetensors"))


def test_a_store_made_from_another_file_is_refused(tiny_gguf, tmp_path):
    file = tiny_gguf("qwen3_moe", "Q4_0")
    target = tmp_path / "store"
    result = CliRunner().invoke(model_group, ["quantize", str(file), "--weights", "int8", "--out", str(target)])
    assert result.exit_code == 0, result.output
    with pytest.raises(quant_store.QuantizedStoreError, match="made from other weights"):
        quant_store.QuantizedReader(target, tiny_gguf("qwen3_moe", "Q8_0"))


def test_calibrate_takes_a_gguf_model_in_the_format_auto_chooses(tiny_gguf, tmp_path, timed):
    file = tiny_gguf("qwen3_moe", "Q4_0")
    document = tmp_path / "doc.txt"
    document.write_text("The harbour master logs every ship that enters the port and the cargo it carries. " * 8)
    plan = tmp_path / "plan.json"
    result = CliRunner().invoke(calibrate_command, ["--model", str(file), "--data", str(document), "--out", str(plan),
                                                    "--threads", "1"])
    assert result.exit_code == 0, result.output
    assert "int4" in result.output and timed == []  # auto kept the file's int4, loaded in bf16 to calibrate
    saved = json.loads(plan.read_text())
    assert saved["model_key"] == load_model(file).key and len(saved["layers"]) == 3
