"""The prefill profile: every part is timed by its own hooks, the parts add up to the chunk, and the
work each part is priced by is what the model really did."""

from __future__ import annotations

import time

import pytest
import torch
from support.cpus import fake_projection_timings

from npumoe.bench.fair.workloads import build_model
from npumoe.bench.profile import PARTS, depths_to_report, profile_prefill, profile_rows
from npumoe.engine.attach.norms import EngineRMSNorm
from npumoe.engine.attach.projections import ProjectionLinear
from npumoe.engine.attach.runtime import MoeRuntime
from npumoe.engine.backends.registry import get_backend
from npumoe.engine.kernels import norm_kernel
from npumoe.engine.synthetic.geometry import parse_geometry

GEOMETRY = parse_geometry("64x8x2x32")


@pytest.fixture(scope="module")
def model():
    return build_model(GEOMETRY, 2, torch.float32, context=512, seed=0)


def test_every_part_is_timed_and_the_parts_add_up_to_the_chunk(model):
    ids = torch.randint(model.config.vocab_size, (96,), generator=torch.Generator().manual_seed(0)).tolist()
    started = time.perf_counter()
    profiles = profile_prefill(model, ids, 32)
    wall = time.perf_counter() - started
    assert [p.depth for p in profiles] == [0, 32, 64]
    for profile in profiles:
        assert all(profile.parts[part].seconds > 0 for part in ("experts", "router", "projections", "attention",
                                                                "cache", "norms", "other"))
        assert "dense_ffn" not in profile.parts  # Qwen3-MoE has no dense layers or shared experts
    assert sum(c.seconds for p in profiles for c in p.parts.values()) <= wall


def test_the_work_counted_is_the_models(model):
    ids = list(range(64))
    first, second = profile_prefill(model, ids, 32)
    hidden, ffn, top_k, layers, tokens = 64, 32, 2, 2, 32
    assert first.parts["experts"].flops == 2 * tokens * top_k * 3 * hidden * ffn * layers
    heads, head_dim = model.config.num_attention_heads, model.model.layers[0].self_attn.head_dim
    # scores and values: each query row against every key so far (the second chunk sees 64)
    assert second.parts["attention"].flops == 2 * heads * tokens * 64 * 2 * head_dim * layers
    assert first.parts["attention"].flops == 2 * heads * tokens * 32 * 2 * head_dim * layers
    # the cache's appended keys and values: each layer's new K and V, once
    kv = model.config.num_key_value_heads * head_dim
    assert first.parts["cache"].bytes == 2 * 2 * tokens * kv * 4 * layers


def test_quantized_experts_are_priced_at_the_bytes_of_their_format(model):
    ids = list(range(64))
    float32 = profile_prefill(model, ids, 32)[0].parts["experts"]
    int4 = profile_prefill(model, ids, 32, experts_format="int4")[0].parts["experts"]
    assert int4.flops == float32.flops
    # fp32: 4 bytes a weight; int4: half a byte, and a bf16 scale and zero for each group of 32
    assert int4.bytes == pytest.approx(float32.bytes * (0.5 + 4 / 32) / 4)


def test_rows_report_each_part_at_the_nearest_chunk_to_each_depth(model):
    profiles = profile_prefill(model, list(range(96)), 32)
    rows = profile_rows(profiles, [0, 64], flop_rate=1e9, bandwidth=1e9)
    assert [(r["depth"], r["part"]) for r in rows] == [(d, p) for d in (0, 64) for p in PARTS]
    assert sum(r["share"] for r in rows if r["depth"] == 0) == pytest.approx(1, abs=0.01)
    experts = next(r for r in rows if r["part"] == "experts" and r["depth"] == 0)
    # x_roofline is rounded to 0.1 and ms to 0.01: equal to the ratio of the two within that rounding
    ratio = experts["ms"] / experts["roofline_ms"]
    assert experts["roofline_ms"] > 0 and experts["x_roofline"] == pytest.approx(
        ratio, abs=0.05 + 0.005 / experts["roofline_ms"] * (1 + ratio))


def test_depths_reported_are_the_first_chunk_the_usual_depths_and_the_last():
    assert depths_to_report(16384, 512) == [0, 2048, 8192, 15872]
    assert depths_to_report(1024, 256) == [0, 768]


def test_the_engines_projections_in_place_of_the_linears_are_still_charged_to_projections(monkeypatch, tmp_path):
    model = build_model(GEOMETRY, 2, torch.float32, context=512, seed=0)
    ids = list(range(64))
    before = profile_prefill(model, ids, 32)[0].parts["projections"]
    fake_projection_timings(monkeypatch, tmp_path / "cache", "int8pack")  # runs on every CPU
    runtime = MoeRuntime(model, get_backend("cpu"), quantized="int8")
    head = model.get_output_embeddings()  # taken too, and charged to the head (a decode step's part)
    swapped = [m for m in model.modules() if isinstance(m, ProjectionLinear) and m is not head]
    assert len(swapped) == 4 * 2 and isinstance(head, ProjectionLinear)  # q, k, v and o of both layers
    try:
        after = profile_prefill(model, ids, 32)[0].parts["projections"]
    finally:
        runtime.detach()
    assert after.seconds > 0
    assert after.flops == before.flops  # the same products, counted from the engine's modules
    # each projection's weight read once, in its format's bytes: int8 codes and their scales instead of fp32
    assert after.bytes == sum(m.weight_nbytes for m in swapped) < before.bytes / 3


def test_the_engines_norms_in_place_of_the_models_are_still_charged_to_norms():
    if (why := norm_kernel.unavailable()) is not None:
        pytest.skip(f"the norm kernel cannot run here: {why}")
    model = build_model(GEOMETRY, 2, torch.float32, context=512, seed=0)
    ids = list(range(64))
    before = profile_prefill(model, ids, 32)[0].parts["norms"]
    runtime = MoeRuntime(model, get_backend("cpu"))
    engine_norms = [m for m in model.modules() if isinstance(m, EngineRMSNorm)]
    assert len(engine_norms) == 4 * 2 + 1  # input, post-attention, q and k norms of both layers, and the final one
    try:
        after = profile_prefill(model, ids, 32)[0].parts["norms"]
    finally:
        runtime.detach()
    assert all(m.calls >= 1 for m in engine_norms)
    assert after.seconds > 0
    assert after.bytes == before.bytes  # each norm reads and writes its input, whichever module computes it
