"""The whole-model prefill benchmark: a real transformers model class at a geometry, engine vs transformers."""

from __future__ import annotations

import pytest
import torch
from support.cpus import fake_projection_timings

from npumoe.bench.fair.workloads import build_model
from npumoe.bench.paths import IMPLS, QUANTIZED_TOLERANCE, TOLERANCE
from npumoe.bench.prefill_bench import PrefillBenchSettings, run_prefill_bench
from npumoe.engine.attach import projections
from npumoe.engine.moe.model_experts import moe_experts
from npumoe.engine.synthetic.geometry import Geometry, parse_geometry

TINY = parse_geometry("64x8x2x32")


def test_the_model_is_the_familys_causal_lm_with_the_asked_layers_at_the_geometry():
    model = build_model(Geometry.sized("t", "olmoe", hidden=64, experts=8, top_k=2, ffn=32), 2, torch.bfloat16,
                        context=256, seed=0)
    assert type(model).__name__ == "OlmoeForCausalLM" and model.dtype == torch.bfloat16
    experts = moe_experts(model)
    assert len(experts) == 2
    assert experts[0][1].gate_up_proj.shape == (8, 64, 64)


def test_every_implementation_prefills_the_same_document_checked_against_eager():
    settings = PrefillBenchSettings(threads=1, layers=2, document_tokens=96, chunk_tokens=32,
                                    calibration_documents=1, warmup=0, repeats=1)
    rows = run_prefill_bench([TINY], ["float32"], settings)
    assert [row["impl"] for row in rows] == list(IMPLS)
    for row in rows:
        assert (row["geometry"], row["layers"], row["document_tokens"], row["chunk_tokens"]) == (
            "64x8x2x32", 2, 96, 32)
        assert row["tokens_per_s"] > 0
    exact = [row for row in rows if not row["impl"].endswith("-prune")]
    assert all(row["status"] == "ok" and row["rel_error"] <= TOLERANCE[torch.float32] for row in exact)
    static = next(row for row in rows if row["impl"] == "npumoe-torch-static")
    assert static["launches"] > 0 and static["dropped_fraction"] == 0


def test_a_chunk_longer_than_the_document_is_refused():
    with pytest.raises(ValueError, match="longer than the document"):
        PrefillBenchSettings(threads=1, document_tokens=64, chunk_tokens=128)


def test_quantized_weights_put_the_engines_quantized_path_beside_the_float_ones(monkeypatch, tmp_path):
    fake_projection_timings(monkeypatch, tmp_path / "cache", "int8pack")  # int8 projections measure fastest
    ran = []
    multiply = projections.multiply

    def counted(kernel, *args):
        ran.append(kernel)
        return multiply(kernel, *args)

    monkeypatch.setattr(projections, "multiply", counted)
    settings = PrefillBenchSettings(threads=1, layers=2, document_tokens=64, chunk_tokens=32,
                                    calibration_documents=1, warmup=0, repeats=1, weights=("int8",))
    rows = {row["impl"]: row for row in run_prefill_bench([TINY], ["bfloat16"], settings)}
    assert list(rows) == [*IMPLS, "npumoe-cpu-int8"]
    quantized = rows["npumoe-cpu-int8"]
    assert quantized["status"] == "approximate" and quantized["tokens_per_s"] > 0
    assert 0 < quantized["rel_error"] <= QUANTIZED_TOLERANCE["int8"]
    assert "int8pack" in ran  # the whole model's projections ran quantized, not only its experts
    assert rows["npumoe-cpu"]["status"] == "ok"


def test_the_profile_splits_each_quantized_paths_time_too(monkeypatch, tmp_path):
    fake_projection_timings(monkeypatch, tmp_path / "cache", "int8pack")
    ran = []
    multiply = projections.multiply
    monkeypatch.setattr(projections, "multiply", lambda kernel, *args: ran.append(kernel) or multiply(kernel, *args))
    calls = {}
    for profile in (False, True):
        ran.clear()
        settings = PrefillBenchSettings(threads=1, layers=2, document_tokens=64, chunk_tokens=32,
                                        calibration_documents=1, warmup=0, repeats=1, weights=("int8",),
                                        profile=profile)
        rows = run_prefill_bench([TINY], ["bfloat16"], settings, bandwidth=1e10)
        calls[profile] = ran.count("int8pack")
    profiled = [row for row in rows if row["impl"] == "profile"]
    assert {row["profiled"] for row in profiled} == {"npumoe-cpu", "npumoe-cpu-int8"}
    assert all(row["ms"] > 0 for row in profiled if row["part"] == "projections")
    assert calls[True] > calls[False]  # the int8 path's profile ran its quantized projections


def test_unknown_quantized_weights_are_refused():
    with pytest.raises(ValueError, match="quantized weights must be among"):
        PrefillBenchSettings(threads=1, document_tokens=64, chunk_tokens=32, weights=("int3",))
