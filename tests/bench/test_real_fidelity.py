"""The weights-format fidelity on real text: perplexity, top-1 and KL of rounded experts against the float model."""

from __future__ import annotations

import math

import pytest
import torch

from npumoe.bench.fidelity.real_text import (
    FLOAT,
    FLOORS,
    RealFidelitySettings,
    Variant,
    expert_weights,
    perplexity,
    run_real_fidelity,
)
from npumoe.engine.formats.quantize import INT4, INT8, quantize
from npumoe.engine.loading.load import load_model

# The tiny experts are 64 wide in and 32 out: groups of 16 and 32 stand in for the demo's 32 and 64.
TINY_VARIANTS = (FLOAT, Variant("int8", INT8), Variant("int4 g16", INT4, 16), Variant("int4 g32", INT4, 32))


@pytest.fixture(scope="module")
def measured(tiny, harbour, orchard):
    loaded = load_model(tiny("mixtral"))
    before = {name: weight.clone() for name, weight in expert_weights(loaded.model).items()}
    rows = run_real_fidelity(loaded, [harbour, orchard], RealFidelitySettings(chunk_tokens=32, tokens_per_document=96),
                             variants=TINY_VARIANTS)
    return loaded, before, {row["variant"]: row for row in rows}


def test_the_float_row_is_the_reference(measured):
    _, _, rows = measured
    float_row = rows["float"]
    assert float_row["tokens"] == 2 * 96
    assert float_row["top1_agreement"] == 1.0 and float_row["mean_kl"] == 0.0
    assert float_row["perplexity_change"] == 0.0 and float_row["weight_error"] == 0.0
    assert 1 < float_row["perplexity"] < math.inf


def test_each_format_rounds_the_experts_and_moves_the_output(measured):
    _, _, rows = measured
    for name in ("int8", "int4 g16", "int4 g32"):
        assert rows[name]["weight_error"] > 0, name  # the rounding ran
        assert rows[name]["mean_kl"] > 0, name
        assert rows[name]["perplexity_change"] == pytest.approx(rows[name]["perplexity"] / rows["float"]["perplexity"]
                                                                - 1)
    assert rows["int8"]["weight_error"] < rows["int4 g16"]["weight_error"] < rows["int4 g32"]["weight_error"]


def test_the_model_gets_its_float_experts_back(measured):
    loaded, before, _ = measured
    for name, weight in expert_weights(loaded.model).items():
        assert torch.equal(weight, before[name]), name


def test_perplexity_of_uniform_logits_is_the_vocabulary_size():
    assert perplexity([torch.zeros(5, 40)], [[1, 2, 3, 4, 5]]) == pytest.approx(40)


def test_int4_aligned_with_a_q4_1_grid_reproduces_it_and_a_wider_group_does_not():
    # Q4_1: each block of 32 weights along a row is q · d + m with q in 0..15, its own d and m; llama.cpp's
    # d = (max − min) / 15, so every block holds both a 0 and a 15
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (64, 8, 32), generator=generator).float()
    codes[..., 0], codes[..., 1] = 0, 15
    d = torch.rand(64, 8, 1, generator=generator) * 0.01 + 0.001
    m = -8 * d + torch.randn(64, 8, 1, generator=generator) * 0.002
    w = (codes * d + m).reshape(64, 256).bfloat16().float()

    def error(group: int) -> float:
        return float((quantize(w, INT4, group=group).dequantize() - w).norm() / w.norm())

    assert error(32) < 0.01
    assert error(64) > 4 * error(32)


def test_the_floor_rows_move_the_output_without_a_format_and_give_the_model_back(tiny, harbour, orchard):
    """bf16 compute, and experts given other exact values (here: the tiny experts' first expert, a little moved, as
    the dense FFN a GGUF would hold), each against the float model; every weight and buffer is as it was after."""
    loaded = load_model(tiny("mixtral"))
    state = {name: tensor.clone() for name, tensor in loaded.model.state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    dense = {name: weight[0] * (1 + 1e-3 * torch.randn(weight.shape[1:], generator=generator))
             for name, weight in expert_weights(loaded.model).items()}
    rows = {row["variant"]: row for row in run_real_fidelity(
        loaded, [harbour, orchard], RealFidelitySettings(chunk_tokens=32, tokens_per_document=64),
        variants=(FLOAT, *FLOORS), dense=dense)}
    in_bf16, exact = (rows[variant.name] for variant in FLOORS)
    assert in_bf16["mean_kl"] > 0 and 0 < in_bf16["weight_error"] < 4e-3  # the random fp32 experts rounded to bf16
    assert exact["mean_kl"] > 0 and exact["weight_error"] > 0 and exact["weight_error_vs_gguf"] == 0
    assert loaded.model.dtype == torch.float32
    for name, tensor in loaded.model.state_dict().items():
        assert torch.equal(tensor, state[name]), name


def test_without_the_gguf_file_the_exact_experts_row_is_left_out(tiny, harbour):
    loaded = load_model(tiny("mixtral"))
    rows = run_real_fidelity(loaded, [harbour], RealFidelitySettings(chunk_tokens=32, tokens_per_document=32),
                             variants=(FLOAT, *FLOORS))
    assert [row["variant"] for row in rows] == ["float", FLOORS[0].name]
