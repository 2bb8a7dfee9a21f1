"""Quantized weight formats (int8 per channel, int4 in groups) and the CPU kernels that run them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cpus import APPLE_SILICON, CPUS, INTEL_MAC, SAPPHIRE_RAPIDS, simulate

from npumoe.engine.formats import quantize as quantize_module
from npumoe.engine.formats.quantize import (
    FORMATS,
    INT4,
    INT8,
    QuantizedWeight,
    pack_int4,
    quantize,
    reference_linear,
    relative_error,
    unpack_int4,
)
from npumoe.engine.kernels import choice as mechanism
from npumoe.engine.kernels import quant_kernels
from npumoe.engine.kernels.quant_kernels import (
    ACTIVATION_DTYPES,
    KERNELS,
    QuantLinear,
    choose_kernel,
    unavailable_kernels,
)
from npumoe.engine.synthetic.geometry import GEOMETRIES


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_int8_codes_are_symmetric_per_output_row_and_the_largest_weight_of_a_row_is_exact():
    w = randn(48, 64, seed=0)
    w[3] = 0  # an all-zero row
    q = quantize(w, INT8)
    assert q.codes.dtype == torch.int8 and q.scale.shape == (48,) and q.zero is None
    assert q.codes.abs().amax(dim=1).tolist() == [0 if row == 3 else 127 for row in range(48)]
    rows = torch.arange(48)
    top = w.abs().argmax(dim=1)
    torch.testing.assert_close(q.dequantize()[rows, top], w[rows, top])
    assert not q.dequantize()[3].any()
    # rounding to nearest: every weight within half a step of its code's value
    assert ((q.dequantize() - w).abs() <= q.scale[:, None] / 2 + 1e-7).all()


def test_int4_codes_are_two_a_byte_each_the_nearest_to_its_weight_on_its_groups_stored_grid():
    w = randn(16, 96, seed=1)
    q = quantize(w, INT4, group=32)
    assert q.codes.shape == (16, 48) and q.scale.shape == q.zero.shape == (16, 3) and q.group == 32
    assert q.scale.dtype == q.zero.dtype == torch.bfloat16
    codes = unpack_int4(q.codes)
    assert torch.equal(pack_int4(codes), q.codes)
    step, zero = (t.float().repeat_interleave(32, dim=1) for t in (q.scale, q.zero))
    exact = (w - zero) / step + 8  # where each weight falls on its group's grid of codes
    reached = (exact >= -0.5) & (exact <= 15.5)
    assert ((codes.float() - exact).abs() <= 0.5 + 1e-3)[reached].all()
    assert (codes[exact < -0.5] == 0).all() and (codes[exact > 15.5] == 15).all()  # clipped to the end codes


def group_errors(w: torch.Tensor, q: QuantizedWeight) -> torch.Tensor:
    return (q.dequantize() - w).square().reshape(w.shape[0], -1, q.group).sum(dim=2)


def test_int4_refits_each_groups_scale_and_zero_and_never_rounds_a_group_worse_than_its_range(monkeypatch):
    w = randn(64, 256, seed=11)
    refitted = quantize(w, INT4)
    monkeypatch.setattr(quantize_module, "_INT4_REFITS", 0)
    spanning = quantize(w, INT4)
    codes = unpack_int4(spanning.codes).reshape(64, -1, 32)
    assert (codes.amin(dim=2) == 0).all() and (codes.amax(dim=2) == 15).all()  # unrefitted: each group's range
    assert (group_errors(w, refitted) <= group_errors(w, spanning) + 1e-6).all()
    assert relative_error(refitted.dequantize(), w) < 0.96 * relative_error(spanning.dequantize(), w)


def test_a_stored_weight_comes_back_whole_from_its_tensors():
    for format in FORMATS:
        q = quantize(randn(32, 64, seed=2), format)
        back = QuantizedWeight.from_tensors(format, q.tensors())
        assert back.group == q.group and torch.equal(back.dequantize(), q.dequantize())


@pytest.mark.parametrize(("w", "format", "message"), [
    (torch.zeros(4, 4, dtype=torch.int8), INT8, "2-D float weight"),
    (torch.zeros(2, 4, 4), INT8, "2-D float weight"),
    (torch.zeros(4, 40), INT4, "multiple of its even group size 32"),
    (torch.zeros(4, 64), "int3", "must be one of int8, int4"),
])
def test_weights_a_format_cannot_hold_are_refused(w, format, message):
    with pytest.raises(ValueError, match=message):
        quantize(w, format)


def test_a_real_geometry_expert_layer_stays_within_the_measured_error_of_each_format():
    """Qwen3-30B-A3B's expert sizes, random weights as geometry builds them, 8 experts summed as top-8 routing
    does. Gaussian weights are the hard case for rounding (no outliers, no structure): at 8 bits per channel
    the layer sits at 1.4 %, at 4 bits in groups of 32 at 13.0 % (the 1 % and 5 % of issue #15 are below what
    rounding each weight to 8 or 4 bits can reach on such weights; see quantize.py)."""
    geometry = GEOMETRIES["qwen3-30b-a3b"]
    hidden, ffn = geometry.hidden, geometry.ffn
    x = randn(64, hidden, seed=3)
    experts = [(randn(2 * ffn, hidden, seed=10 + e) / hidden**0.5, randn(hidden, ffn, seed=100 + e) / ffn**0.5)
               for e in range(geometry.top_k)]

    def layer(linear) -> torch.Tensor:
        total = torch.zeros(64, hidden)
        for gate_up, down in experts:
            gate, up = linear(x, gate_up).chunk(2, dim=-1)
            total += linear(F.silu(gate) * up, down)
        return total / geometry.top_k

    exact = layer(lambda rows, w: rows @ w.T)
    errors = {format: relative_error(layer(lambda rows, w, f=format: reference_linear(rows, quantize(w, f))), exact)
              for format in FORMATS}
    assert 0.012 < errors[INT8] < 0.016
    assert 0.12 < errors[INT4] < 0.14


def _kernels_here(format: str, dtype: torch.dtype, weight: QuantizedWeight) -> list[str]:
    return [k for k in KERNELS[format] if k not in unavailable_kernels(format, dtype, weight)]


@pytest.mark.parametrize("dtype", ACTIVATION_DTYPES, ids=str)
@pytest.mark.parametrize("format", FORMATS)
def test_every_kernel_that_runs_here_matches_the_dequantized_reference_at_each_row_count(format, dtype):
    q = quantize(randn(192, 256, seed=4), format)
    calls = {kernel: 0 for kernel in KERNELS[format]}
    for kernel in _kernels_here(format, dtype, q):
        linear = QuantLinear(q, kernel, dtype)
        for rows in (1, 5, 32, 70):
            x = randn(rows, 256, seed=rows).to(dtype)
            y = linear(x)
            calls[kernel] += 1
            assert y.shape == (rows, 192) and y.dtype == dtype
            # weight-only kernels: the reference up to float rounding; dynamic ones round x to 8 bits as well
            bound = 0.012 if kernel.endswith("dynamic") else 0.004 if dtype == torch.bfloat16 else 1e-5
            assert relative_error(y, reference_linear(x.float(), q)) < bound, (kernel, rows)
    assert calls["dequantize"] == 4  # the kernel that runs anywhere ran
    assert sum(calls.values()) == 4 * len(_kernels_here(format, dtype, q))


def test_a_kernel_writes_into_out_and_takes_no_rows():
    q = quantize(randn(64, 64, seed=5), INT8)
    linear = QuantLinear(q, "int8pack", torch.float32)
    out = torch.empty(3, 64)
    assert linear(randn(3, 64, seed=6), out).data_ptr() == out.data_ptr()
    assert QuantLinear(q, "dequantize", torch.float32)(torch.zeros(0, 64)).shape == (0, 64)



def test_a_transposed_weight_quantizes_as_its_contiguous_copy_for_every_kernel():
    """Experts stored (E, in, out), as gpt-oss's are, are quantized from a transposed view: strided codes would be
    misread by oneDNN's prepack and refused by torch's int8pack."""
    stored = randn(256, 192, seed=8)
    strided, packed = quantize(stored.T, INT8), quantize(stored.T.contiguous(), INT8)
    assert strided.codes.is_contiguous() and torch.equal(strided.codes, packed.codes)
    x = randn(5, 256, seed=9)
    kernels = _kernels_here(INT8, torch.float32, strided)
    assert "int8pack" in kernels
    for kernel in kernels:
        got, want = QuantLinear(strided, kernel, torch.float32)(x), QuantLinear(packed, kernel, torch.float32)(x)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-4), kernel


@pytest.mark.parametrize("bad", ["wrong kernel", "wrong dtype", "wrong width"])
def test_what_a_kernel_cannot_take_is_refused(bad):
    q = quantize(randn(64, 64, seed=5), INT4)
    with pytest.raises(ValueError, match=r"kernel must be one of|quantized linear|activations"):
        if bad == "wrong kernel":
            QuantLinear(q, "int8pack", torch.float32)
        elif bad == "wrong dtype":
            QuantLinear(q, "dequantize", torch.float32)(torch.zeros(2, 64, dtype=torch.bfloat16))
        else:
            QuantLinear(q, "dequantize", torch.float32)(torch.zeros(2, 32))


@pytest.mark.parametrize("cpu", CPUS, ids=lambda cpu: cpu.name)
def test_onednn_int8_runs_only_where_oneDNN_does_and_the_fallback_everywhere(monkeypatch, cpu):
    simulate(monkeypatch, cpu)
    weight = quantize(randn(64, 64, seed=7), INT8)
    unavailable = unavailable_kernels(INT8, torch.float32, weight)
    assert ("onednn-dynamic" in unavailable) == (cpu is APPLE_SILICON)
    assert "dequantize" not in unavailable and "int8pack" not in unavailable


def test_int4pack_needs_output_widths_in_sixteens(monkeypatch):
    simulate(monkeypatch, INTEL_MAC)  # no VNNI, so no kernel of the engine's own either
    odd = quantize(randn(40, 64, seed=8), INT4)
    assert "multiple of 16" in unavailable_kernels(INT4, torch.float32, odd)["int4pack"]
    choice = choose_kernel([odd], [quantize(randn(64, 32, seed=9), INT4)], torch.float32)
    assert choice.winner == "dequantize" and choice.seconds == {}


def _experts(format: str, count: int = 2) -> tuple[list[QuantizedWeight], list[QuantizedWeight]]:
    return ([quantize(randn(64, 32, seed=e), format) for e in range(count)],
            [quantize(randn(32, 32, seed=50 + e), format) for e in range(count)])


@pytest.mark.parametrize("format", FORMATS)
def test_the_kernel_measured_fastest_is_chosen_and_cached_for_the_next_process(tmp_path, monkeypatch, format):
    simulate(monkeypatch, SAPPHIRE_RAPIDS)
    monkeypatch.setenv("NPUMOE_CACHE", str(tmp_path))
    fastest = KERNELS[format][-1]  # the one that is slowest in truth: the choice must follow the timing
    calls: list[tuple[str, ...]] = []

    def fake_timing(kernels, gate_up, down, dtype):
        calls.append(tuple(kernels))
        return {kernel: 1e-3 if kernel == fastest else 2e-3 for kernel in kernels}

    monkeypatch.setattr(quant_kernels, "time_kernels", fake_timing)
    choice = choose_kernel(*_experts(format), torch.bfloat16)
    runnable = tuple(kernel for kernel in KERNELS[format] if kernel not in choice.unavailable)  # AMX: the OS decides
    assert choice.winner == fastest and calls == [runnable]
    monkeypatch.setattr(mechanism, "_chosen", {})  # a new process
    assert choose_kernel(*_experts(format), torch.bfloat16) == choice
    assert len(calls) == 1
    assert f"bfloat16 format {format} hidden 32 ffn 32 threads 1" in quant_kernels.CHOICES.cached()
    choose_kernel(*_experts(format), torch.float32)  # another activation dtype: a choice of its own
    assert len(calls) == 2


def test_real_timing_runs_every_kernel_here_single_threaded(tmp_path, monkeypatch):
    monkeypatch.setenv("NPUMOE_CACHE", str(tmp_path))
    monkeypatch.setattr(mechanism, "_chosen", {})
    gate_up, down = _experts(INT8, count=3)
    choice = choose_kernel(gate_up, down, torch.float32)
    assert choice.seconds.keys() == set(_kernels_here(INT8, torch.float32, gate_up[0]))
    assert choice.winner == min(choice.seconds, key=choice.seconds.__getitem__)
    assert all(seconds > 0 for seconds in choice.seconds.values())
