"""`bench memory`: a child process loads a checkpoint through the engine, processes one document, reports its peak."""

from __future__ import annotations

import pytest

from npumoe.bench.memory import MemorySettings, measure
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
