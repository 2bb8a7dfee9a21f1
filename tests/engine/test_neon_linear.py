"""The engine's arm64 kernels: neon_linear's int8 and int4 matmuls (SDOT and SMMLA), torch's KleidiAI 4-bit kernel as
another int4 candidate, and the Arm CPU features they are chosen by. The layouts and the mapping of the engine's int4
onto KleidiAI's run anywhere; the kernels themselves only on arm64 (`make test-arm64` runs them under emulation)."""

from __future__ import annotations

import ctypes
import platform

import pytest
import torch
from support.cpus import fresh_process
from test_vnni_linear import ROW_COUNTS, assert_matches, randn, reference, silu_glu_float, silu_glu_reference

from npumoe.engine.formats.quantize import FORMATS, INT4, INT8, quantize, relative_error, unpack_int4
from npumoe.engine.kernels import host, neon_linear, quant_kernels
from npumoe.engine.kernels.quant_kernels import KLEIDIAI, NEON, QuantLinear, choose_kernel, silu_glu_ffn

ARM64 = platform.machine().lower() in ("aarch64", "arm64")
SDOT_AND_I8MM = pytest.mark.parametrize("i8mm", [False, True], ids=["sdot", "i8mm"])
EACH_FORMAT = pytest.mark.parametrize("format", FORMATS)
# (N, K): whole blocks of 16; N not a multiple of 16; int8: K whole octets, and not a multiple of 8 (nor of 4);
# int4: groups of 32, K an odd number of them
SHAPES = {INT8: [(192, 256), (100, 70), (1, 130)], INT4: [(192, 256), (100, 96), (1, 160)]}
EXPERT_SHAPES = {INT8: [(256, 128), (128, 72), (64, 40)], INT4: [(256, 128), (128, 96), (96, 32)]}


def skip_without(i8mm: bool) -> None:
    """Skip unless the kernel runs here (on x86: always; the tests that call this are marked arm64)."""
    why = neon_linear.i8mm_unavailable() if i8mm else neon_linear.unavailable()
    if why is not None:
        pytest.skip(f"no NEON kernel here: {why}")


def test_int8_octets_hold_pairs_of_columns_eight_codes_each_padded_to_whole_blocks():
    q = quantize(randn(100, 70, seed=1), INT8)
    packed = neon_linear.pack(q)
    assert packed.codes.shape == (7, 9, 8, 2, 8) and packed.scale.shape == (112,)
    for block, octet, pair, column in ((0, 0, 0, 0), (3, 5, 2, 1), (6, 1, 1, 1)):
        n = block * 16 + 2 * pair + column
        assert torch.equal(packed.codes[block, octet, pair, column], q.codes[n, 8 * octet:8 * octet + 8])
    assert not packed.codes[:, 8, :, :, 6:].any()  # K 70 of 72: the last octet's two padding codes are 0
    assert not packed.codes[6, :, 2:].any() and not packed.scale[100:].any()  # N 100 of 112: padding columns 0
    assert torch.equal(packed.scale[:100], q.scale.float())


def test_int4_hexadecets_hold_a_columns_first_octet_in_low_nibbles_and_its_second_in_high_ones():
    q = quantize(randn(100, 96, seed=1), INT4)
    packed = neon_linear.pack(q)
    codes = unpack_int4(q.codes)
    assert packed.codes.shape == (7, 6, 8, 2, 8) and packed.scale.shape == packed.zero.shape == (7, 3, 16)
    for block, hexadecet, pair, column in ((0, 0, 0, 0), (3, 5, 2, 1), (6, 1, 1, 1)):
        n = block * 16 + 2 * pair + column
        byte = packed.codes[block, hexadecet, pair, column].int()
        assert torch.equal(byte & 15, codes[n, 16 * hexadecet:16 * hexadecet + 8].int())
        assert torch.equal(byte >> 4, codes[n, 16 * hexadecet + 8:16 * hexadecet + 16].int())
        group = hexadecet // 2
        assert packed.scale[block, group, 2 * pair + column] == q.scale[n, group]
        assert packed.zero[block, group, 2 * pair + column] == q.zero[n, group]
    assert not packed.codes[6, :, 2:].any() and not packed.scale[6, :, 4:].any()  # N 100 of 112: padding 0


def test_the_neon_kernel_takes_int4_in_groups_of_sixteens_and_never_runs_off_arm64():
    assert neon_linear.unsupported(quantize(randn(16, 64, seed=2), INT4)) is None
    assert "multiple of 16" in neon_linear.unsupported(quantize(randn(16, 64, seed=2), INT4, group=8))
    if not ARM64:
        assert "arm64" in neon_linear.unavailable()
        for format in FORMATS:
            unavailable = quant_kernels.unavailable_kernels(format, torch.float32,
                                                            quantize(randn(16, 64, seed=2), format))
            assert all("arm64" in unavailable[kernel] for kernel in NEON[format])


def test_cpuinfos_features_line_gives_the_arm_features_and_an_x86_one_none():
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes asimddp sve i8mm bf16 sha3\n"
    assert host.arm_features_listed(arm) == {"asimddp", "i8mm", "bf16"}
    assert host.arm_features_listed("Features\t: fp asimd crc32\n") == frozenset()  # an Armv8.0 core
    assert host.arm_features_listed("flags\t\t: fpu sse2 avx2 avx512f\n") is None  # x86's, as qemu-user shows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kleidiais_symmetric_4bit_kernel_runs_the_engines_int4_with_its_zero_points_added(dtype, monkeypatch):
    """Off Arm, torch's op is a reference loop with the same contract: the mapping is tested on every machine."""
    q = quantize(randn(96, 256, seed=3), INT4)
    assert q.zero.float().abs().mean() > 0.1  # zero points that matter: leaving them out would be far off
    calls = []
    op = torch.ops.aten._dyn_quant_matmul_4bit
    monkeypatch.setattr(torch.ops.aten, "_dyn_quant_matmul_4bit", lambda *args: calls.append(1) or op(*args))
    linear = QuantLinear(q, KLEIDIAI, dtype)
    for rows in (1, 5, 70):
        x = randn(rows, 256, seed=rows).to(dtype)
        out = torch.full((rows, 96), float("nan"), dtype=dtype)
        assert linear(x, out) is out and out.dtype == dtype
        assert relative_error(out, x.double() @ q.dequantize().double().T) < quant_kernels.bound(KLEIDIAI, dtype)
    assert len(calls) == 3


def test_kleidiai_needs_groups_in_thirty_twos_and_a_torch_built_with_it(monkeypatch):
    monkeypatch.setattr(torch.backends.kleidiai, "is_available", lambda: True)
    assert KLEIDIAI not in quant_kernels.unavailable_kernels(INT4, torch.float32, quantize(randn(16, 64, seed=4), INT4))
    sixteens = quantize(randn(16, 64, seed=4), INT4, group=16)
    assert "multiple of 32" in quant_kernels.unavailable_kernels(INT4, torch.float32, sixteens)[KLEIDIAI]
    monkeypatch.setattr(torch.backends.kleidiai, "is_available", lambda: False)
    assert "KleidiAI" in quant_kernels.unavailable_kernels(INT4, torch.float32, sixteens)[KLEIDIAI]


@pytest.mark.arm64
@EACH_FORMAT
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@SDOT_AND_I8MM
def test_every_row_count_and_shape_matches_x_rounded_per_row_times_the_dequantized_weight(i8mm, dtype, format):
    skip_without(i8mm)
    for n, k in SHAPES[format]:
        q = quantize(randn(n, k, seed=n + k), format)
        packed = neon_linear.pack(q)
        for rows in ROW_COUNTS:
            x = randn(rows, k, seed=rows).to(dtype)
            out = torch.full((rows, n), float("nan"), dtype=dtype)  # only the kernel can fill it
            assert neon_linear.linear(x, packed, out, i8mm=i8mm) is out
            assert_matches(out, reference(x, q))


@pytest.mark.arm64
@EACH_FORMAT
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_smmla_gives_the_sdot_kernels_results_bit_for_bit(dtype, format):
    skip_without(True)
    n, k = SHAPES[format][1]
    q = neon_linear.pack(quantize(randn(n, k, seed=5), format))
    for rows in ROW_COUNTS:
        x = randn(rows, k, seed=rows)
        x[::3, :2] *= 50  # rows with outliers: two levels of codes, an odd count of code rows
        x = x.to(dtype)
        assert torch.equal(neon_linear.linear(x, q, i8mm=True), neon_linear.linear(x, q))


@pytest.mark.arm64
@EACH_FORMAT
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@SDOT_AND_I8MM
def test_a_gated_expert_in_one_call_is_its_two_matmuls_with_silu_between(i8mm, dtype, format):
    skip_without(i8mm)
    for hidden, inter in EXPERT_SHAPES[format]:
        up = quantize(randn(2 * inter, hidden, seed=hidden) / 4, format)
        down = quantize(randn(hidden, inter, seed=inter), format)
        packed_up, packed_down = neon_linear.pack(up), neon_linear.pack(down)
        for rows in ROW_COUNTS:
            x = randn(rows, hidden, seed=rows).to(dtype)
            out = torch.full((rows, hidden), float("nan"), dtype=dtype)
            assert neon_linear.silu_glu_expert(x, packed_up, packed_down, out, i8mm=i8mm) is out
            error = relative_error(out, silu_glu_reference(x, up, down))
            assert error <= (1e-3 if dtype == torch.float32 else 4e-3), (hidden, inter, rows, error)


@pytest.mark.arm64
@EACH_FORMAT
@SDOT_AND_I8MM
def test_rows_with_outliers_are_rounded_in_two_levels(i8mm, format):
    skip_without(i8mm)
    weight = quantize(randn(192, 1024, seed=1), format)
    x = randn(20, 1024, seed=2)
    x[::2, :2] = 50.0  # two outliers in a row of 1,024: one level would lose 4.7 % of it (bound: 3 %)
    got = neon_linear.linear(x, neon_linear.pack(weight), i8mm=i8mm)
    exact = x.double() @ weight.dequantize().double().T
    assert relative_error(got[1::2], reference(x[1::2], weight)) < 1e-5  # plain rows: one level, as the reference
    assert relative_error(got[::2], exact[::2]) < 1e-3 < 1e-2 < relative_error(reference(x[::2], weight), exact[::2])
    hidden, inter = 512, 192  # and through a whole expert
    up = quantize(randn(2 * inter, hidden, seed=1) / hidden**0.5, format)
    down = quantize(randn(hidden, inter, seed=2) / inter**0.5, format)
    x = randn(40, hidden, seed=3)
    x[::2, :4] *= 50
    got = neon_linear.silu_glu_expert(x, neon_linear.pack(up), neon_linear.pack(down), i8mm=i8mm)
    floor = silu_glu_float(x, up.dequantize(), down.dequantize())
    assert relative_error(got[::2], floor[::2]) < 0.02 < 0.04 < relative_error(silu_glu_reference(x, up, down)[::2],
                                                                                floor[::2])


@pytest.mark.parametrize("bad", ["dtype", "width", "stride", "out"])
def test_inputs_the_kernel_cannot_read_are_refused_before_it_runs(bad):
    packed = neon_linear.pack(quantize(randn(32, 64, seed=6), INT8))
    x, out = randn(3, 64, seed=7), torch.empty(3, 32)
    x = {"dtype": x.double(), "width": x[:, :60], "stride": randn(64, 3, seed=7).T}.get(bad, x)
    out = torch.empty(3, 32, dtype=torch.bfloat16) if bad == "out" else out
    with pytest.raises(ValueError, match="NEON int8 linear"):
        neon_linear.linear(x, packed, out)


@pytest.mark.arm64
@EACH_FORMAT
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_quantized_linear_and_expert_run_the_neon_kernel(monkeypatch, dtype, format):
    skip_without(False)
    calls = []
    for name in ("linear", "silu_glu_expert"):
        real = getattr(neon_linear, name)
        monkeypatch.setattr(neon_linear, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or
                            _real(*a, **kw))
    up, down = quantize(randn(128, 64, seed=8), format), quantize(randn(64, 64, seed=9), format)
    x = randn(5, 64, seed=10).to(dtype)
    for kernel in (k for k in NEON[format] if k not in quant_kernels.unavailable_kernels(format, dtype, up)):
        gate_up, projection = QuantLinear(up, kernel, dtype), QuantLinear(down, kernel, dtype)
        assert_matches(gate_up(x), reference(x, up))
        expert = silu_glu_ffn(gate_up, projection, x)
        assert relative_error(expert, silu_glu_reference(x, up, down)) < 4e-3
    assert calls.count("linear") >= 1 and calls.count("linear") == calls.count("silu_glu_expert")


@pytest.mark.arm64
@pytest.mark.skipif(not ARM64 or platform.system() != "Linux", reason="needs arm64 Linux")
def test_the_arm_features_read_here_are_the_kernels_hardware_capabilities():
    getauxval = ctypes.CDLL(None).getauxval
    getauxval.argtypes, getauxval.restype = [ctypes.c_ulong], ctypes.c_ulong
    expected = {name for name, (_, word, bit) in host.ARM_FEATURES.items() if getauxval(word) & bit}
    assert host.arm_features() == expected


@pytest.mark.arm64
@pytest.mark.skipif(not ARM64, reason="needs an arm64 CPU (make test-arm64 emulates one)")
@pytest.mark.parametrize("format", [INT8, INT4])
def test_on_arm64_the_choice_offers_the_arm_kernels_and_takes_one_within_its_bound(tmp_path, monkeypatch, format):
    fresh_process(monkeypatch, tmp_path)
    gate_up = [quantize(randn(256, 128, seed=e), format) for e in range(2)]
    down = [quantize(randn(128, 128, seed=10 + e), format) for e in range(2)]
    choice = choose_kernel(gate_up, down, torch.float32)
    arm = list(NEON[format]) + ([KLEIDIAI] if format == INT4 else [])
    offered = [kernel for kernel in arm if kernel not in choice.unavailable]
    assert offered and all(kernel in choice.seconds or kernel in choice.refused for kernel in offered), choice
    assert choice.winner in choice.seconds and choice.winner not in choice.refused
    print(f"{format}: took {choice.winner}; timed {choice.seconds}; refused {choice.refused}; "
          f"unavailable {choice.unavailable}")
