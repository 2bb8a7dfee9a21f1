"""The engine's AVX2 int8/int4 kernel: its results against the dequantized weights times x rounded per row (on
vnni_linear's packing), its accuracy where library int8 saturates, how the choice takes it, and the
NPUMOE_MAX_CPU_ISA ceiling that narrows the engine's own kernels to it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from support.cpus import APPLE_SILICON, INTEL_MAC, SAPPHIRE_RAPIDS, fake_build, fresh_process, simulate
from test_vnni_linear import EXPERT_SHAPES, ROW_COUNTS, SHAPES, assert_matches, randn, reference, silu_glu_reference

from npumoe.engine.formats.quantize import FORMATS, INT4, INT8, quantize, relative_error
from npumoe.engine.kernels import (
    attention_kernel,
    avx2_linear,
    bf16_linear,
    host,
    norm_kernel,
    quant_kernels,
    vnni_linear,
)
from npumoe.engine.kernels.choice import Accuracy
from npumoe.engine.kernels.quant_kernels import (
    AMX,
    AVX2,
    AVX_VNNI,
    OWN,
    QuantLinear,
    choose_kernel,
    unavailable_kernels,
)

needs_kernel = pytest.mark.skipif(avx2_linear.unavailable() is not None,
                                  reason=f"no AVX2 kernel here: {avx2_linear.unavailable()}")
needs_vnni = pytest.mark.skipif(avx2_linear.vnni_unavailable() is not None,
                                reason=f"no AVX-VNNI here: {avx2_linear.vnni_unavailable()}")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("format", FORMATS)
def test_every_row_count_and_shape_matches_x_rounded_per_row_times_the_dequantized_weight(format, dtype):
    for n, k in SHAPES[format]:
        q = quantize(randn(n, k, seed=n + k), format)
        packed = vnni_linear.pack(q)
        for rows in ROW_COUNTS:
            x = randn(rows, k, seed=rows).to(dtype)
            out = torch.full((rows, n), float("nan"), dtype=dtype)  # only the kernel can fill it
            assert avx2_linear.linear(x, packed, out) is out
            assert_matches(out, reference(x, q))


@needs_kernel
@pytest.mark.skipif(vnni_linear.unavailable() is not None, reason=f"no VNNI kernel here: {vnni_linear.unavailable()}")
@pytest.mark.parametrize("format", FORMATS)
def test_on_one_packing_it_gives_the_vnni_kernels_results_up_to_float_rounding(format):
    q = quantize(randn(192, 1024, seed=3), format)
    packed = vnni_linear.pack(q)
    x = randn(40, 1024, seed=4)
    x[::3, :2] *= 50  # int8: rows with outliers take two levels of codes in both
    torch.testing.assert_close(avx2_linear.linear(x, packed), vnni_linear.linear(x, packed), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("format", FORMATS)
def test_a_gated_expert_in_one_call_is_its_two_matmuls_with_silu_between(format, dtype):
    for hidden, inter in EXPERT_SHAPES[format]:
        up = quantize(randn(2 * inter, hidden, seed=hidden) / 4, format)
        down = quantize(randn(hidden, inter, seed=inter), format)
        packed_up, packed_down = vnni_linear.pack(up), vnni_linear.pack(down)
        for rows in ROW_COUNTS:
            x = randn(rows, hidden, seed=rows).to(dtype)
            out = torch.full((rows, hidden), float("nan"), dtype=dtype)
            assert avx2_linear.silu_glu_expert(x, packed_up, packed_down, out) is out
            error = relative_error(out, silu_glu_reference(x, up, down))
            assert error <= (1e-3 if dtype == torch.float32 else 4e-3), (hidden, inter, rows, error)


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_on_avx_vnni_int8_gives_the_avx2_tiles_results_bit_for_bit(dtype):
    """The same int32 sums by other instructions: every float after them is computed alike."""
    for n, k in SHAPES[INT8]:
        packed = vnni_linear.pack(quantize(randn(n, k, seed=n + k), INT8))
        for rows in ROW_COUNTS:
            x = randn(rows, k, seed=rows)
            x[::3, :2] *= 50  # rows with outliers: two levels of codes
            x = x.to(dtype)
            assert torch.equal(avx2_linear.linear(x, packed, vnni=True), avx2_linear.linear(x, packed))
    for hidden, inter in EXPERT_SHAPES[INT8]:
        up = vnni_linear.pack(quantize(randn(2 * inter, hidden, seed=hidden) / 4, INT8))
        down = vnni_linear.pack(quantize(randn(hidden, inter, seed=inter), INT8))
        x = randn(70, hidden, seed=5).to(dtype)
        expert = avx2_linear.silu_glu_expert(x, up, down, vnni=True)
        assert torch.equal(expert, avx2_linear.silu_glu_expert(x, up, down))


@needs_vnni
def test_the_avx_vnni_kernel_runs_where_it_is_chosen_and_takes_int8_only(monkeypatch):
    calls = []
    real_linear, real_expert = avx2_linear.linear, avx2_linear.silu_glu_expert
    monkeypatch.setattr(avx2_linear, "linear", lambda *a, **kw: calls.append(("linear", kw)) or real_linear(*a, **kw))
    monkeypatch.setattr(avx2_linear, "silu_glu_expert", lambda *a, **kw: calls.append(("expert", kw)) or
                        real_expert(*a, **kw))
    up, down = quantize(randn(256, 128, seed=6), INT8), quantize(randn(128, 128, seed=7), INT8)
    gate_up, project_down = QuantLinear(up, AVX_VNNI, torch.float32), QuantLinear(down, AVX_VNNI, torch.float32)
    x = randn(9, 128, seed=8)
    assert_matches(gate_up(x), reference(x, up))
    assert relative_error(quant_kernels.silu_glu_ffn(gate_up, project_down, x), silu_glu_reference(x, up, down)) < 1e-3
    assert calls == [("linear", {"vnni": True}), ("expert", {"vnni": True})]
    int4 = vnni_linear.pack(quantize(randn(64, 64, seed=9), INT4))
    with pytest.raises(ValueError, match="AVX-VNNI kernel cannot run this: it takes int8 weights"):
        avx2_linear.linear(randn(2, 64, seed=1), int4, vnni=True)


@needs_kernel
@pytest.mark.parametrize(("rows", "k"), [(20, 1024), (75, 8192)])  # the second: five panels of rows (avx2_linear.c)
def test_an_int8_linear_rounds_rows_with_outliers_in_two_levels(rows, k):
    weight = quantize(randn(192, k, seed=1), INT8)
    x = randn(rows, k, seed=2)
    x[::2, :2] = 50.0  # one level would lose 4.7 % of such a row (bound: 3 %)
    got = avx2_linear.linear(x, vnni_linear.pack(weight))
    exact = x.double() @ weight.dequantize().double().T
    assert relative_error(got[1::2], reference(x[1::2], weight)) < 1e-5
    assert relative_error(got[::2], exact[::2]) < 1e-3 < 1e-2 < relative_error(reference(x[::2], weight), exact[::2])


@needs_kernel
def test_each_block_of_a_wide_int8_weight_reads_only_its_own_sums_on_the_workers():
    """Each block of 64 columns once finished every column after it too, reading its rows' sums past their end:
    in the worker threads' malloc arenas, whose ends are unmapped, 16 rows of two levels against a 4096-wide
    projection (the choice's probe for Qwen3-30B-A3B's q_proj) crashed the process. In a process of its own, so
    a crash fails this test, not the suite."""
    script = textwrap.dedent("""
        from functools import partial
        import torch
        from npumoe.engine.formats.quantize import INT8, quantize, relative_error
        from npumoe.engine.kernels import avx2_linear, vnni_linear
        from npumoe.engine.kernels.workers import run_tasks
        torch.set_num_threads(2)
        generator = torch.Generator().manual_seed(0)
        weight = quantize(torch.randn(4096, 2048, generator=generator), INT8)
        x = torch.randn(32, 2048, generator=generator)
        x[:, :2] = 50.0  # every row takes two levels of codes
        out = torch.full((32, 4096), float("nan"))
        packed = vnni_linear.pack(weight)
        run_tasks([partial(avx2_linear.linear, x[s:s + 16], packed, out[s:s + 16]) for s in (0, 16)])
        print(relative_error(out, x.double() @ weight.dequantize().double().T))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert float(run.stdout.splitlines()[-1]) < 1e-3


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("format", FORMATS)
def test_on_the_probes_rows_of_the_whole_int8_range_it_stays_within_the_dynamic_bound(format, dtype):
    """The ±1 rows round to ±127: where int16 pair sums of u8×s8 saturate (oneDNN's int8 without VNNI), they
    would be several times the bound."""
    up = quantize(randn(2 * 768, 2048, seed=5) / 2048**0.5, format)  # an expert's real width
    accuracy = quant_kernels.probe_kernels([AVX2[format]], up, dtype)[AVX2[format]]
    assert accuracy.refusal() is None and accuracy.bound == quant_kernels.bound(AVX2[format], dtype)
    x = quant_kernels.probe_rows(8, 2048, dtype)[1::2]  # the ±1 rows alone: exact int32 sums, as the reference's
    assert_matches(QuantLinear(up, AVX2[format], dtype)(x), reference(x.float(), up))


@needs_kernel
@pytest.mark.parametrize("format", FORMATS)
def test_the_quantized_linear_and_the_expert_run_the_avx2_kernel(monkeypatch, format):
    calls = []
    real_linear, real_expert = avx2_linear.linear, avx2_linear.silu_glu_expert
    monkeypatch.setattr(avx2_linear, "linear", lambda x, *rest, **kw: calls.append(("linear", len(x))) or
                        real_linear(x, *rest, **kw))
    monkeypatch.setattr(avx2_linear, "silu_glu_expert", lambda x, *rest, **kw: calls.append(("expert", len(x))) or
                        real_expert(x, *rest, **kw))
    up, down = quantize(randn(256, 128, seed=6), format), quantize(randn(128, 128, seed=7), format)
    gate_up, project_down = QuantLinear(up, AVX2[format], torch.float32), QuantLinear(down, AVX2[format],
                                                                                       torch.float32)
    x = randn(9, 128, seed=8)
    assert_matches(gate_up(x), reference(x, up))
    y = quant_kernels.silu_glu_ffn(gate_up, project_down, x)
    assert relative_error(y, silu_glu_reference(x, up, down)) < 1e-3
    assert calls == [("linear", 9), ("expert", 9)]


@needs_kernel
def test_inputs_the_kernel_cannot_read_are_refused_before_it_runs():
    packed = vnni_linear.pack(quantize(randn(64, 64, seed=9), INT8))
    with pytest.raises(ValueError, match="AVX2 int8 linear"):
        avx2_linear.linear(randn(4, 64, seed=10).half(), packed)
    with pytest.raises(ValueError, match="gate-up \\(2I, K\\) and down \\(N, I\\) weights of one format"):
        avx2_linear.silu_glu_expert(randn(2, 64, seed=1), packed, packed)


@pytest.fixture
def fresh_build(tmp_path, monkeypatch):
    fresh_process(monkeypatch, tmp_path)
    return tmp_path


@pytest.mark.parametrize(("cpu", "reason"), [(INTEL_MAC, None),
                                             (APPLE_SILICON, "the AVX2 kernel is for x86-64 CPUs, this is arm64")],
                         ids=lambda value: getattr(value, "name", ""))
def test_it_is_built_where_avx2_is_and_the_vnni_kernels_are_not(fresh_build, monkeypatch, cpu, reason):
    simulate(monkeypatch, cpu)
    build = fake_build(monkeypatch, fresh_build)
    assert avx2_linear.unavailable() == reason
    assert avx2_linear.vnni_unavailable() == (reason or "this CPU lacks AVX-VNNI")
    for format in FORMATS:
        unavailable = unavailable_kernels(format, torch.float32, quantize(randn(64, 64, seed=11), format))
        assert unavailable.get(AVX2[format]) == reason and OWN[format] in unavailable
    assert [run.rpartition("/")[2] for run in build.runs] == ([] if reason else ["avx2_linear.c"])


def probe_within_bounds(kernels, weight, dtype):
    return {kernel: Accuracy(0.0, quant_kernels.bound(kernel, dtype)) for kernel in kernels}


@pytest.mark.parametrize("format", FORMATS)
def test_under_the_isa_ceiling_every_own_kernel_above_avx2_says_so_and_the_choice_takes_the_avx2_one(
        fresh_build, monkeypatch, format):
    simulate(monkeypatch, SAPPHIRE_RAPIDS)  # a CPU with all of them: only the ceiling can refuse
    build = fake_build(monkeypatch, fresh_build)
    monkeypatch.setenv(host.MAX_ISA_VARIABLE, "avx2")
    assert vnni_linear.unavailable() == vnni_linear.amx_unavailable() == "NPUMOE_MAX_CPU_ISA=avx2 excludes avx512_vnni"
    assert bf16_linear.unavailable() == "NPUMOE_MAX_CPU_ISA=avx2 excludes avx512_bf16"
    avx512 = "NPUMOE_MAX_CPU_ISA=avx2 excludes avx512"
    assert attention_kernel.unavailable(torch.bfloat16) == norm_kernel.unavailable() == avx512
    assert attention_kernel.body(torch.float32) == "avx2"  # float32 attention has an AVX2 body
    assert avx2_linear.vnni_unavailable() == "NPUMOE_MAX_CPU_ISA=avx2 excludes avx2_vnni"
    timed = []

    def fake_timing(kernels, gate_up, down, dtype):
        timed.append(tuple(kernels))
        return {kernel: 1e-3 if kernel == AVX2[format] else 2e-3 for kernel in kernels}

    monkeypatch.setattr(quant_kernels, "time_kernels", fake_timing)
    monkeypatch.setattr(quant_kernels, "probe_kernels", probe_within_bounds)  # the fake library computes nothing
    weights = [quantize(randn(64, 64, seed=12), format)]
    choice = choose_kernel(weights, weights, torch.float32)
    assert choice.winner == AVX2[format] and len(timed) == 1 and not {OWN[format], AMX} & set(timed[0])
    assert choice.unavailable[OWN[format]] == "NPUMOE_MAX_CPU_ISA=avx2 excludes avx512_vnni"
    assert [run.rpartition("/")[2] for run in build.runs] == ["avx2_linear.c"]  # nothing above the ceiling built


def test_the_isa_ceiling_lets_through_what_it_allows_and_refuses_a_value_it_does_not_know(monkeypatch):
    monkeypatch.setenv(host.MAX_ISA_VARIABLE, "AVX512_BF16")
    assert host.isa_ceiling_refuses("avx512_vnni") is None and host.isa_ceiling_refuses("avx512_bf16") is None
    assert host.isa_ceiling_refuses("amx") == "NPUMOE_MAX_CPU_ISA=avx512_bf16 excludes amx"
    monkeypatch.setenv(host.MAX_ISA_VARIABLE, "avx3")
    with pytest.raises(ValueError, match=r"NPUMOE_MAX_CPU_ISA must be one of avx2, avx2_vnni, .*, not 'avx3'"):
        host.isa_ceiling_refuses("avx2")
    monkeypatch.delenv(host.MAX_ISA_VARIABLE)
    assert host.isa_ceiling_refuses("amx") is None
