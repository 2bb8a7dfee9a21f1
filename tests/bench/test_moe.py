"""The MoE-layer benchmark: real experts classes, skewed routing, a correctness gate before any timing."""

from __future__ import annotations

import pytest
import torch

from npumoe.bench.fair.paired import best_engine_row, round_ratios
from npumoe.bench.layer.moe import MoeBenchSettings, run_moe_bench
from npumoe.bench.layer.roofline import active_flops, moe_roofline
from npumoe.bench.paths import (
    IMPLS,
    QUANTIZED_TOLERANCE,
    TOLERANCE,
    calibration_from_loads,
    gate,
    measure_impls,
    static_plans,
)
from npumoe.engine.kernels import quant_kernels
from npumoe.engine.kernels.quant_kernels import QuantLinear
from npumoe.engine.moe.model_experts import moe_experts
from npumoe.engine.synthetic.geometry import (
    GEOMETRIES,
    Geometry,
    build_layer_model,
    draw_routing,
    parse_geometry,
    routing_prior,
)

TINY = parse_geometry("64x8x2x32")
QUICK = MoeBenchSettings(threads=1, warmup=0, repeats=1, calibration_chunks=4)


def test_named_geometries_give_the_real_models_moe_sizes():
    sizes = {name: (g.family, g.hidden, g.experts, g.top_k, g.ffn) for name, g in GEOMETRIES.items()}
    assert sizes["qwen3-30b-a3b"] == ("qwen3_moe", 2048, 128, 8, 768)
    assert sizes["phi-3.5-moe"] == ("phimoe", 4096, 16, 2, 6400)
    assert sizes["olmoe-1b-7b"] == ("olmoe", 2048, 64, 8, 1024)
    assert sizes["gpt-oss-20b"] == ("gpt_oss", 2880, 32, 4, 2880)
    assert sizes["deepseek-v2-lite"] == ("deepseek_v2", 2048, 64, 6, 1408)


def test_a_custom_geometry_is_written_hidden_experts_topk_ffn():
    assert parse_geometry("64x8x2x32") == Geometry.sized("64x8x2x32", "qwen3_moe", hidden=64, experts=8, top_k=2,
                                                         ffn=32)


@pytest.mark.parametrize("text", ["qwen4", "64x8x2", "64x2x8x32", "0x8x2x32"])
def test_a_bad_geometry_is_refused_by_name(text):
    with pytest.raises(ValueError, match=text):
        parse_geometry(text)


@pytest.mark.parametrize(("family", "class_name"), [("qwen3_moe", "Qwen3MoeExperts"), ("phimoe", "PhimoeExperts"),
                                                    ("olmoe", "OlmoeExperts")])
def test_the_layer_is_the_familys_own_experts_module_in_the_asked_dtype(family, class_name):
    geometry = Geometry.sized("t", family, hidden=32, experts=4, top_k=2, ffn=16)
    model = build_layer_model(geometry, torch.bfloat16, torch.Generator().manual_seed(0))
    (_, experts), = moe_experts(model)
    assert type(experts).__name__ == class_name
    assert experts.gate_up_proj.shape == (4, 32, 32) and experts.down_proj.shape == (4, 32, 16)
    assert experts.gate_up_proj.dtype == torch.bfloat16 and experts.gate_up_proj.device.type == "cpu"


def test_routing_picks_k_distinct_experts_with_normalised_weights():
    generator = torch.Generator().manual_seed(0)
    index, weights = draw_routing(routing_prior(TINY, generator), 500, TINY.top_k, generator)
    assert index.shape == weights.shape == (500, 2)
    assert (index[:, 0] != index[:, 1]).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(500))


def test_routing_skew_makes_the_most_popular_expert_the_busiest():
    geometry = Geometry.sized("g", "qwen3_moe", hidden=8, experts=16, top_k=2, ffn=8)
    generator = torch.Generator().manual_seed(0)
    prior = routing_prior(geometry, generator, skew=1.5)
    counts = torch.bincount(draw_routing(prior, 2000, 2, generator)[0].reshape(-1), minlength=16)
    assert counts.argmax() == prior.argmax()
    assert counts.max() > 4 * counts.min()
    uniform = routing_prior(geometry, generator, skew=0.0)
    flat = torch.bincount(draw_routing(uniform, 2000, 2, generator)[0].reshape(-1), minlength=16)
    assert flat.max() < 1.5 * flat.min()


def test_active_flops_count_gate_up_and_down_for_every_routed_token():
    assert active_flops(tokens=10, top_k=2, hidden=8, ffn=4) == 2 * 10 * 2 * (8 * 8 + 4 * 8)


def test_the_roofline_is_the_slower_of_compute_and_weight_reads():
    roofline = moe_roofline(tokens=16, top_k=2, hidden=32, ffn=16, experts_touched=4, dtype=torch.float32,
                            bandwidth=1e6, warmup=0, repeats=1)
    assert roofline.weight_bytes == 4 * 3 * 32 * 16 * 4
    assert roofline.memory_s == roofline.weight_bytes / 1e6
    assert roofline.seconds == max(roofline.compute_s, roofline.memory_s)
    assert roofline.bound == "memory"  # 24 KiB at 1 MB/s is far slower than the matmul


def test_the_roofline_takes_the_fastest_dense_matmul_timed_beside_the_implementations():
    roofline = moe_roofline(tokens=16, top_k=2, hidden=32, ffn=16, experts_touched=4, dtype=torch.bfloat16,
                            bandwidth=1e12, compute_times={"torch": 5.0, "npumoe-bf16": 2.0})
    assert (roofline.compute_s, roofline.compute_kernel, roofline.bound) == (2.0, "npumoe-bf16", "compute")
    assert roofline.weight_bytes == 4 * 3 * 32 * 16 * 2


def test_one_run_reports_every_implementation_checked_and_timed_then_the_roofline():
    rows = run_moe_bench([TINY], [32], ["float32"], QUICK, bandwidth=1e10)
    assert [row["impl"] for row in rows] == [*IMPLS, "roofline"]
    for row in rows:
        assert (row["geometry"], row["tokens"], row["dtype"], row["threads"]) == ("64x8x2x32", 32, "float32", 1)
        assert row["tokens_per_s"] > 0 and row["vs_roofline"] > 0
        low, median, high = row["vs_roofline_range"]  # every row's ratio, round by round, the roofline's too
        assert low <= median <= high
    assert all(row["load_s"] == pytest.approx(row["prepare_s"] + row["first_chunk_s"]) and row["load_s"] > 0
               for row in rows if row["impl"] != "roofline")
    exact = [row for row in rows if row["impl"] != "roofline" and not row["impl"].endswith("-prune")]
    assert all(row["status"] == "ok" and row["rel_error"] <= TOLERANCE[torch.float32] for row in exact)
    assert max(row["vs_transformers_best"] for row in rows if row["impl"].startswith("transformers-")) == 1.0
    static = next(row for row in rows if row["impl"] == "npumoe-torch-static")
    assert 0 <= static["padding_fraction"] < 1 and static["dropped_fraction"] == 0
    assert next(row for row in rows if row["impl"].endswith("-prune"))["status"] == "approximate"


def tiny_layer(dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    model = build_layer_model(TINY, dtype, generator)
    prior = routing_prior(TINY, generator)
    (name, experts), = moe_experts(model)
    loads = torch.stack([torch.bincount(draw_routing(prior, 32, 2, generator)[0].reshape(-1), minlength=8)
                         for _ in range(4)])
    plans = static_plans(calibration_from_loads([(name, loads)], chunk_tokens=32, source="test"), model="tiny",
                         hidden=64, ffn=32, dtype=dtype)
    x = torch.randn(32, 64, generator=generator).to(dtype)
    index, weights = draw_routing(prior, 32, 2, generator)
    return model, experts, plans, (x, index, weights.to(dtype))


def test_an_engine_path_whose_output_differs_is_refused_and_never_timed():
    model, experts, plans, inputs = tiny_layer()

    def run():  # a broken engine: right shape, wrong numbers
        y = experts(*inputs)
        return y * 1.01 if model.config._experts_implementation == "npumoe" else y

    with torch.inference_mode():
        rows = {row["impl"]: row for row in measure_impls(model, plans, run, tokens=32, warmup=0, repeats=1)}
    for impl in ("npumoe-cpu", "npumoe-torch-static"):
        assert rows[impl]["status"] == "refused" and "relative error" in rows[impl]["error"]
        assert "tokens_per_s" not in rows[impl]
    assert rows["transformers-grouped_mm"]["status"] == "ok"


def test_quantized_engine_paths_run_quantized_and_are_timed_as_approximate_within_their_bound(monkeypatch):
    model, experts, plans, inputs = tiny_layer(torch.bfloat16)
    calls = {"n": 0}
    call = QuantLinear.__call__

    def counted(self, *args, **kwargs):
        calls["n"] += 1
        return call(self, *args, **kwargs)

    monkeypatch.setattr(QuantLinear, "__call__", counted)
    fused = quant_kernels.silu_glu_ffn  # the engine's own kernels run a silu-gated expert in one call

    def counted_fused(*args, **kwargs):
        calls["n"] += 1
        return fused(*args, **kwargs)

    monkeypatch.setattr(quant_kernels, "silu_glu_ffn", counted_fused)
    with torch.inference_mode():
        rows = {row["impl"]: row for row in measure_impls(model, plans, lambda: experts(*inputs), tokens=32,
                                                           warmup=0, repeats=1, weights=("int8", "int4"))}
    assert calls["n"] > 0
    for format in ("int8", "int4"):
        row = rows[f"npumoe-cpu-{format}"]
        assert row["status"] == "approximate" and row["tokens_per_s"] > 0
        assert 0 < row["rel_error"] <= QUANTIZED_TOLERANCE[format] == row["tolerance"]
    assert rows["npumoe-cpu"]["status"] == "ok"


def test_a_quantized_path_beyond_its_error_bound_is_refused():
    model, experts, plans, inputs = tiny_layer(torch.bfloat16)

    def run():
        y = experts(*inputs)
        return y * 1.2 if model.config._experts_implementation == "npumoe" else y

    with torch.inference_mode():
        rows = {row["impl"]: row for row in measure_impls(model, plans, run, tokens=32, warmup=0, repeats=1,
                                                           weights=("int8",))}
    assert rows["npumoe-cpu-int8"]["status"] == "refused" and "tokens_per_s" not in rows["npumoe-cpu-int8"]


def test_a_transformers_implementation_that_cannot_run_is_skipped_and_the_rest_still_run():
    model, experts, plans, inputs = tiny_layer()

    def run():
        if model.config._experts_implementation == "grouped_mm":
            raise NotImplementedError("no grouped_mm kernel here")
        return experts(*inputs)

    with torch.inference_mode():
        rows = {row["impl"]: row for row in measure_impls(model, plans, run, tokens=32, warmup=0, repeats=1)}
    assert rows["transformers-grouped_mm"]["status"] == "skipped"
    assert "no grouped_mm kernel here" in rows["transformers-grouped_mm"]["error"]
    assert rows["npumoe-torch-static"]["status"] == "ok" and rows["npumoe-torch-static"]["tokens_per_s"] > 0


def test_implementations_are_timed_in_alternating_rounds_after_each_is_checked():
    model, experts, plans, inputs = tiny_layer()
    ran: list[str] = []

    def run():
        ran.append(model.config._experts_implementation)
        return experts(*inputs)

    with torch.inference_mode():
        rows = measure_impls(model, plans, run, tokens=32, warmup=0, repeats=3)
    assert all(row["status"] in ("ok", "approximate") and row["tokens_per_s"] > 0 for row in rows)
    assert all(len(row["round_seconds"]) == 3 and row["seconds"] == sorted(row["round_seconds"])[1] for row in rows)
    timed = ran[1 + len(IMPLS):]  # after the reference and one check each
    assert len(timed) == 3 * len(IMPLS)
    rounds = [timed[i:i + len(IMPLS)] for i in range(0, len(timed), len(IMPLS))]
    assert all(sorted(r) == sorted(rounds[0]) for r in rounds)  # every implementation once a round
    assert model.config._experts_implementation == "eager"  # and the model is left as it was


def test_round_ratios_pair_the_rounds_two_paths_shared():
    fast, slow = {"round_seconds": [1.0, 2.0, 1.5]}, {"round_seconds": [2.0, 3.0, 4.5]}
    assert round_ratios(fast, slow) == [2.0, 1.5, 3.0]  # a slow second round slowed both alike
    with pytest.raises(ValueError):
        round_ratios(fast, {"round_seconds": [1.0]})


def test_the_gate_tolerates_bf16_rounding_but_not_a_wrong_answer():
    reference = torch.randn(16, 8, dtype=torch.bfloat16)
    rounded = (reference.double() * (1 + 1e-3)).to(torch.bfloat16)
    assert gate("npumoe-cpu", rounded, reference)["status"] == "ok"
    assert gate("npumoe-cpu", reference * 1.1, reference)["status"] == "refused"
    assert gate("npumoe-cpu", reference * float("nan"), reference)["status"] == "refused"
    assert gate("npumoe-torch-static-prune", reference * 1.1, reference)["status"] == "approximate"


def test_bad_benchmark_settings_are_refused():
    with pytest.raises(ValueError, match="dtypes"):
        run_moe_bench([TINY], [32], ["fp16"], QUICK, bandwidth=1e10)
    with pytest.raises(ValueError, match="repeats"):
        MoeBenchSettings(threads=1, repeats=0)


def test_the_engines_best_path_is_an_exact_one_that_passed_the_check():
    rows = [{"impl": "npumoe-cpu", "status": "ok", "tokens_per_s": 10.0, "round_seconds": [1.0]},
            {"impl": "npumoe-torch-static", "status": "refused", "error": "differs"},
            {"impl": "npumoe-torch-static-prune", "status": "approximate", "tokens_per_s": 99.0},
            {"impl": "transformers-grouped_mm", "status": "ok", "tokens_per_s": 50.0}]
    assert best_engine_row(rows)["impl"] == "npumoe-cpu"
    assert best_engine_row(rows[1:]) is None


def test_host_packing_times_a_layer_calls_packing_and_unpacking_with_every_expert_resident(monkeypatch):
    from npumoe.bench.layer import host_packing
    from npumoe.engine.moe.dispatch import MoeLayer
    from npumoe.engine.synthetic.geometry import parse_geometry

    calls = {"pack": 0, "unpack": 0}
    for name in calls:
        real = getattr(MoeLayer, name)

        def counted(self, *args, name=name, real=real):
            calls[name] += 1
            return real(self, *args)

        monkeypatch.setattr(MoeLayer, name, counted)
    seconds = host_packing.host_packing_seconds(parse_geometry("64x8x2x32"), 16, torch.float32, repeats=3)
    assert seconds["pack_s"] > 0 and seconds["unpack_s"] > 0
    assert calls["pack"] >= 3 and calls["unpack"] >= 3  # the timed calls are the layer's own
