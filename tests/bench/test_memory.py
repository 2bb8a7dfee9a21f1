"""`bench memory`: a child process loads a checkpoint through the engine, processes one document, reports its peak."""

from __future__ import annotations

import pytest

from npumoe.bench import memory
from npumoe.bench.memory import GGUF_TYPES, MemorySettings, gguf_weights, measure, write_gguf_file
from npumoe.engine.loading.model_size import checkpoint_tensors, model_size


@pytest.mark.slow  # a child process per format, measured (make chaos)
@pytest.mark.parametrize("weights", ["bf16", "int4"])
def test_the_child_loads_processes_the_document_and_its_peak_is_set_beside_the_weights_bytes(tiny, weights):
    folder = tiny("qwen3_moe")
    row = measure(folder, weights, MemorySettings(document_tokens=300, chunk_tokens=128))
    assert row["tokens"] == 300  # the document the child made has exactly the tokens asked for
    assert row["streamed"]  # read tensor by tensor, not by from_pretrained
    assert row["kernel"] in ({"npumoe-int4-dynamic", "int4pack", "dequantize"} if weights == "int4"
                             else {"npumoe-bf16", "onednn", "torch"})
    assert row["weight_bytes"] == model_size(checkpoint_tensors(folder)).formats[weights].total_bytes
    assert row["before_rss"] < row["loaded_rss"] <= row["peak_rss"]
    assert row["peak_over_before"] == row["peak_rss"] - row["before_rss"]
    assert row["ratio"] == row["peak_over_before"] / row["weight_bytes"]


def test_an_unknown_format_is_refused_before_any_process_starts(tiny):
    with pytest.raises(ValueError, match="weights must be one of"):
        measure(tiny("qwen3_moe"), "int2", MemorySettings())


@pytest.mark.slow  # a child process, measured (make chaos)
def test_a_gguf_file_written_from_the_checkpoint_is_measured_in_the_format_its_blocks_load_into(tiny, tmp_path):
    file = write_gguf_file(tiny("qwen3_moe"), "Q4_0", tmp_path / "model.gguf")
    row = measure(file, gguf_weights("Q4_0"), MemorySettings(document_tokens=300, chunk_tokens=128))
    assert row["weights"] == "int4" and row["streamed"] and row["tokens"] == 300
    assert row["weight_bytes"] == model_size(checkpoint_tensors(file)).formats["int4"].total_bytes


def test_each_gguf_type_the_bench_writes_loads_without_widening():
    assert {t: gguf_weights(t) for t in GGUF_TYPES} == {"Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4", "F16": "bf16"}


def test_an_unknown_gguf_type_or_a_missing_model_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    written = []
    monkeypatch.setattr(memory, "write_checkpoint", lambda *args: written.append(args))
    with pytest.raises(ValueError, match="GGUF types must be among"):
        memory.run_memory_bench("qwen3-30b-a3b", ["int8"], MemorySettings(), ["Q2_K"])
    with pytest.raises(ValueError, match="no such checkpoint folder or GGUF file"):
        memory.run_model_memory_bench(tmp_path / "absent.gguf", ["int8"], MemorySettings())
    assert written == []
