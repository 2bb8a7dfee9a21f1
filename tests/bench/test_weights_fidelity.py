"""The weights-format fidelity benchmark: bf16, int8 and int4 against fp32, whole tiny models and one layer."""

from __future__ import annotations

import math

import pytest
import torch

from npumoe.bench.fidelity import weights as weights_fidelity
from npumoe.bench.fidelity.weights import WeightsFidelitySettings, fit_readout, layer_errors, run_weights_fidelity
from npumoe.engine.formats.quantize import quantize
from npumoe.engine.loading.load import load_model
from npumoe.engine.synthetic.geometry import (
    build_layer_model,
    draw_routing,
    layer_experts,
    parse_geometry,
    routing_prior,
)

SMALL = parse_geometry("64x8x2x32")


@pytest.fixture
def quantized_runs(monkeypatch) -> list[str]:
    """The formats the engine's runtime was built with, recorded as the benchmark builds it."""
    formats: list[str] = []
    real = weights_fidelity.MoeRuntime

    def recording(*args, **kwargs):
        formats.append(kwargs["quantized"])
        return real(*args, **kwargs)

    monkeypatch.setattr(weights_fidelity, "MoeRuntime", recording)
    return formats


@pytest.fixture(scope="module")
def readout_model(tiny, harbour):
    loaded = load_model(tiny("qwen3_moe"))
    before = loaded.model.get_output_embeddings().weight.clone()
    cross_entropy = fit_readout(loaded, [harbour], 64, max_tokens=1024)
    return loaded, before, cross_entropy


def test_the_readout_learns_the_text_and_replaces_the_output_layer(readout_model, harbour):
    loaded, before, cross_entropy = readout_model
    vocabulary = loaded.model.get_output_embeddings().weight.shape[0]
    assert not torch.equal(before, loaded.model.get_output_embeddings().weight)
    assert cross_entropy < math.log(vocabulary) - 1  # far better than a uniform guess over the bytes


def test_each_format_is_compared_with_fp32_and_with_its_own_float_model(tiny, orchard, quantized_runs):
    rows = run_weights_fidelity(load_model(tiny("qwen3_moe")), orchard, WeightsFidelitySettings(chunk_tokens=64,
                                                                                               eval_tokens=128))
    by = {row["format"]: row for row in rows}
    assert list(by) == ["fp32", "bf16", "int8", "int4"] and quantized_runs == ["int8", "int4"]
    assert (by["fp32"]["top1_vs_fp32"], by["fp32"]["kl_vs_fp32"]) == (1.0, 0.0)
    assert by["bf16"]["vs_float"] == "bf16" and by["bf16"]["kl_vs_float"] == 0.0 and by["bf16"]["kl_vs_fp32"] > 0
    for format in ("int8", "int4"):
        assert by[format]["vs_float"] == "bf16" and by[format]["kl_vs_float"] > 0
    assert by["int4"]["kl_vs_float"] > by["int8"]["kl_vs_float"]  # coarser rounding, further from the float model
    assert all(row["eval_tokens"] == 128 for row in rows)


def test_a_fitted_readout_makes_the_float_models_agree_more_than_a_random_one(tiny, readout_model, orchard):
    settings = WeightsFidelitySettings(chunk_tokens=64, eval_tokens=256, formats=("bf16",))
    fitted = run_weights_fidelity(readout_model[0], orchard, settings)[0]
    random = run_weights_fidelity(load_model(tiny("qwen3_moe")), orchard, settings)[0]
    assert fitted["top1_vs_fp32"] >= random["top1_vs_fp32"]


def test_the_reference_must_be_fp32(tiny, orchard):
    with pytest.raises(ValueError, match="the reference must be the fp32 model"):
        run_weights_fidelity(load_model(tiny("qwen3_moe"), dtype="bfloat16"), orchard, WeightsFidelitySettings())


@pytest.mark.parametrize("distribution", ["gaussian", "heavy-weights", "heavy"])
def test_a_layer_s_quantized_experts_miss_by_more_in_int4_than_in_int8(distribution, quantized_runs):
    rows = layer_errors(SMALL, ["int8", "int4"], distribution, tokens=64)
    assert quantized_runs == ["int8", "int4"]
    errors = {row["format"]: row["rel_error"] for row in rows}
    assert 0 < errors["int8"] < errors["int4"] < 0.5
    # the format's floor (its rounded weights alone) is below what the engine, which also rounds activations, gets
    assert all(0 < row["weights_alone_error"] < 1.1 * row["rel_error"] for row in rows)
    assert all((row["geometry"], row["distribution"], row["tokens"]) == (SMALL.name, distribution, 64) for row in rows)


def test_the_floor_runs_the_layer_on_weights_rounded_to_the_format_and_puts_them_back(monkeypatch):
    generator = torch.Generator().manual_seed(0)
    experts = layer_experts(build_layer_model(SMALL, torch.float32, generator))
    x = torch.randn(16, SMALL.hidden, generator=generator)
    index, weights = draw_routing(routing_prior(SMALL, generator), 16, SMALL.top_k, generator)
    before = [p.clone() for p in experts.parameters()]
    rounded = []
    monkeypatch.setattr(weights_fidelity, "quantize", lambda w, format: rounded.append(format) or quantize(w, format))
    got = weights_fidelity._with_rounded_weights(experts, "int4", x, index, weights)
    assert rounded == ["int4"] * (2 * SMALL.experts)  # every expert's gate-up and down
    assert all(torch.equal(p, b) for p, b in zip(experts.parameters(), before, strict=True))
    with torch.no_grad():
        for p in experts.parameters():
            if p.ndim == 3:
                p.copy_(torch.stack([quantize(w, "int4").dequantize() for w in p]))
        torch.testing.assert_close(got, experts(x, index, weights))


def test_heavy_tailed_weights_have_the_gaussian_draw_s_scale_but_heavier_tails():
    experts = layer_experts(build_layer_model(SMALL, torch.float32, torch.Generator().manual_seed(0)))
    std = experts.gate_up_proj.std().item()
    weights_fidelity._heavy_weights(experts, SMALL, torch.Generator().manual_seed(1))
    w = experts.gate_up_proj.flatten()
    kurtosis = ((w - w.mean()) ** 4).mean() / w.var() ** 2
    assert 0.7 * std < w.std().item() < 1.6 * std and kurtosis > 4  # a Gaussian's is 3


def test_unknown_distributions_and_formats_are_refused():
    with pytest.raises(ValueError, match="distribution must be one of gaussian, heavy-weights, heavy"):
        layer_errors(SMALL, ["int8"], "uniform")
    with pytest.raises(ValueError, match="formats must be among int8, int4"):
        layer_errors(SMALL, ["bf16"], "gaussian")
