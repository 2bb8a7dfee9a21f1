"""The engine's VNNI int8/int4 kernel: its packed layouts, its results against the dequantized weights times x
rounded per row, its fallbacks, and where it is built."""

from __future__ import annotations

import pytest
import torch
from support.cpus import APPLE_SILICON, ICE_LAKE, INTEL_MAC, SAPPHIRE_RAPIDS, ZEN4, fake_build, fresh_process, simulate

from npumoe.engine.formats.quantize import FORMATS, INT4, INT8, QuantizedWeight, quantize, relative_error, unpack_int4
from npumoe.engine.kernels import quant_kernels, vnni_linear
from npumoe.engine.kernels.quant_kernels import AMX, OWN, QuantLinear, choose_kernel, quantize_rows, unavailable_kernels

needs_kernel = pytest.mark.skipif(vnni_linear.unavailable() is not None,
                                  reason=f"no VNNI kernel here: {vnni_linear.unavailable()}")
needs_amx = pytest.mark.skipif(vnni_linear.amx_unavailable() is not None,
                               reason=f"no AMX kernel here: {vnni_linear.amx_unavailable()}")
ROW_COUNTS = (1, 5, 32, 70, 300)
# (N, K): whole blocks; N not a multiple of 64; K not a multiple of 64 (int8: nor of 4; int4: groups of 32)
SHAPES = {INT8: [(192, 256), (100, 70), (1, 130)], INT4: [(192, 256), (130, 96), (1, 160)]}


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def reference(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x rounded per row as the kernel rounds it, times the dequantized weight, in float64."""
    codes, scale = quantize_rows(x)
    return (codes.double() * scale.double()) @ weight.dequantize().double().T


def assert_matches(y: torch.Tensor, exact: torch.Tensor) -> None:
    """float32: the int32 sums are exact, so only the final scaling's float rounding; bf16: one rounding of that."""
    if y.dtype == torch.float32:
        torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-6 * float(exact.abs().max()))
    else:
        torch.testing.assert_close(y.float(), exact.to(torch.bfloat16).float(), rtol=2**-7,
                                   atol=1e-6 * float(exact.abs().max()))


def test_int8_blocks_hold_amx_tiles_of_four_k_values_by_16_columns_padded_to_whole_tiles():
    q = quantize(randn(100, 70, seed=0), INT8)
    packed = vnni_linear.pack(q)
    # (block of 64 columns, chunk of 64 inputs, run of 16 columns, quad of inputs, column in the run, 4 inputs)
    assert packed.codes.shape == (2, 2, 4, 16, 16, 4) and packed.sums.shape == packed.scale.shape == (128,)
    for block, quad, column in ((0, 0, 0), (1, 5, 35), (0, 16, 63)):
        tile = packed.codes[block, quad // 16, column // 16, quad % 16, column % 16]
        assert torch.equal(tile, q.codes[block * 64 + column, 4 * quad:4 * quad + 4])
    assert packed.codes[:, 1, :, 1, :, 2:].eq(0).all() and packed.codes[:, 1, :, 2:].eq(0).all()  # K to 128
    assert packed.codes[1, :, 2, :, 4:].eq(0).all() and packed.codes[1, :, 3].eq(0).all()  # N to 128
    assert torch.equal(packed.sums[:100], q.codes.sum(dim=1, dtype=torch.int32)) and not packed.scale[100:].any()


def test_int4_blocks_hold_k_values_8j_to_8j_plus_3_in_low_nibbles_and_the_next_four_in_high_ones():
    q = quantize(randn(130, 96, seed=1), INT4)
    packed = vnni_linear.pack(q)
    codes = unpack_int4(q.codes)
    assert packed.codes.shape == (3, 12, 64, 4) and packed.scale.shape == packed.zero.shape == (3, 3, 64)
    for block, octet, column in ((0, 0, 0), (2, 11, 1), (1, 7, 40)):
        byte = packed.codes[block, octet, column].int()
        n = block * 64 + column
        assert torch.equal(byte & 0xF, codes[n, 8 * octet:8 * octet + 4].int())
        assert torch.equal(byte >> 4, codes[n, 8 * octet + 4:8 * octet + 8].int())
    assert torch.equal(packed.scale[2, :, 1], q.scale[129]) and torch.equal(packed.zero[1, 2, 40], q.zero[104, 2])
    assert not packed.scale[2, :, 2:].float().any()  # padding columns: scale 0


def reference_int4_codes(q: QuantizedWeight) -> torch.Tensor:
    """The int4 layout as the packing first built it, code by code: what the word-wise packing must give bit for
    bit."""
    n, k = q.shape
    codes = torch.nn.functional.pad(unpack_int4(q.codes), (0, 0, 0, -n % 64))
    octets = codes.reshape(-1, 64, k // 8, 2, 4)  # [..., 0, :] low nibbles, [..., 1, :] high
    return (octets[..., 0, :] | (octets[..., 1, :] << 4)).permute(0, 2, 1, 3).contiguous()


@pytest.mark.parametrize(("n", "k"), SHAPES[INT4])
def test_int4_codes_are_packed_word_by_word_as_code_by_code_bit_for_bit(n, k):
    # random codes (every nibble value in every place), also from memory that does not start on a word
    held = torch.randint(0, 256, (n * k // 2 + 1,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    scale = zero = torch.ones(n, k // 32, dtype=torch.bfloat16)
    for codes in (held[:-1].reshape(n, k // 2), held[1:].reshape(n, k // 2)):
        q = QuantizedWeight(INT4, codes, scale, zero, 32)
        assert torch.equal(vnni_linear.pack(q).codes, reference_int4_codes(q))


@pytest.mark.parametrize(("n", "k"), SHAPES[INT8])
def test_int8_codes_are_packed_a_quad_at_a_time_as_byte_by_byte(n, k):
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=torch.Generator().manual_seed(n))
    packed = vnni_linear.pack(QuantizedWeight(INT8, codes, torch.ones(n)))
    padded = torch.nn.functional.pad(codes, (0, -k % 64, 0, -n % 64))
    # the layout as the packing first built it, byte by byte
    reference = padded.reshape(-1, 4, 16, padded.shape[1] // 64, 16, 4).permute(0, 3, 1, 4, 2, 5).contiguous()
    assert torch.equal(packed.codes, reference) and torch.equal(packed.sums, padded.sum(dim=1, dtype=torch.int32))


@needs_kernel
def test_symmetric_int4_weights_share_one_zero_buffer_and_compute_what_their_dequantized_weights_do():
    """Q4_0's blocks have no zero (w = d·(q - 8)): packed, every such weight of a shape reads one shared buffer of
    zeros instead of holding its own, and computes the same."""
    weights = []
    for seed in (0, 1):
        q = quantize(randn(130, 96, seed=seed), INT4)
        weights.append(QuantizedWeight(INT4, q.codes, q.scale, torch.zeros_like(q.zero), q.group))
    first, second = (vnni_linear.pack(w) for w in weights)
    assert first.zero.data_ptr() == second.zero.data_ptr() and not first.zero.any()
    asymmetric = vnni_linear.pack(quantize(randn(130, 96, seed=2), INT4))
    assert asymmetric.zero.data_ptr() != first.zero.data_ptr()
    x = randn(5, 96, seed=3)
    assert_matches(vnni_linear.linear(x, second), reference(x, weights[1]))


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
            assert vnni_linear.linear(x, packed, out) is out
            assert_matches(out, reference(x, q))


@needs_amx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int8_on_amx_tiles_gives_the_vnni_kernels_results_bit_for_bit(dtype):
    for n, k in SHAPES[INT8]:
        q = quantize(randn(n, k, seed=n + k), INT8)
        packed = vnni_linear.pack(q)
        for rows in ROW_COUNTS:
            x = randn(rows, k, seed=rows).to(dtype)
            out = torch.full((rows, n), float("nan"), dtype=dtype)
            vnni_linear.linear(x, packed, out, amx=True)
            assert_matches(out, reference(x, q))
            assert torch.equal(out, vnni_linear.linear(x, packed))


def silu_glu_reference(x: torch.Tensor, up: QuantizedWeight, down: QuantizedWeight) -> torch.Tensor:
    """x rounded per row through the dequantized gate-up weight, silu(gate)·up, rounded per row again through the
    dequantized down weight, in float64."""
    gate, value = reference(x, up).chunk(2, dim=-1)
    return reference(torch.nn.functional.silu(gate) * value, down)


# (H, I): whole blocks; I not a multiple of 64 (nor, for int8, of 16: the activation's masked tail)
EXPERT_SHAPES = {INT8: [(256, 128), (128, 72), (64, 40)], INT4: [(256, 128), (128, 96)]}


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
            assert vnni_linear.silu_glu_expert(x, packed_up, packed_down, out) is out
            # float32 inside against float64 here: a rare activation rounds to the neighbouring int8 code
            error = relative_error(out, silu_glu_reference(x, up, down))
            assert error <= (1e-3 if dtype == torch.float32 else 4e-3), (hidden, inter, rows, error)


@needs_amx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_gated_expert_on_amx_tiles_gives_the_vnni_kernels_results_bit_for_bit(dtype):
    for hidden, inter in EXPERT_SHAPES[INT8]:
        up = vnni_linear.pack(quantize(randn(2 * inter, hidden, seed=hidden) / 4, INT8))
        down = vnni_linear.pack(quantize(randn(hidden, inter, seed=inter), INT8))
        for rows in ROW_COUNTS:
            x = randn(rows, hidden, seed=rows)
            x[::3, :2] *= 50  # rows with outliers: two levels of codes in both kernels
            x = x.to(dtype)
            assert torch.equal(vnni_linear.silu_glu_expert(x, up, down, amx=True),
                               vnni_linear.silu_glu_expert(x, up, down))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_gated_expert_rounds_rows_with_outliers_in_two_levels_and_loses_little(dtype):
    hidden, inter = 512, 192
    up = quantize(randn(2 * inter, hidden, seed=1) / hidden**0.5, INT8)
    down = quantize(randn(hidden, inter, seed=2) / inter**0.5, INT8)
    x = randn(40, hidden, seed=3)
    x[::2, :4] *= 50  # outlier features in every other row: one int8 level rounds the rest of such a row away
    x = x.to(dtype)
    got = vnni_linear.silu_glu_expert(x, vnni_linear.pack(up), vnni_linear.pack(down))
    x = x.float()
    one_level = silu_glu_reference(x, up, down)  # every row rounded once, as the plain rows are
    floor = silu_glu_float(x, up.dequantize(), down.dequantize())  # the weights' own rounding alone
    assert relative_error(got[1::2], one_level[1::2]) < (1e-3 if dtype == torch.float32 else 4e-3)
    # beyond the weights' own rounding, one level loses 5 % of the outlier rows, two levels 1.2 %
    assert relative_error(got[::2], floor[::2]) < 0.02 < 0.04 < relative_error(one_level[::2], floor[::2])


@needs_kernel
@pytest.mark.parametrize("amx", [False, True], ids=["vnni", "amx"])
def test_an_int8_linear_rounds_rows_with_outliers_in_two_levels(amx):
    if amx and vnni_linear.amx_unavailable() is not None:
        pytest.skip(f"no AMX kernel here: {vnni_linear.amx_unavailable()}")
    weight = quantize(randn(192, 1024, seed=1), INT8)
    x = randn(20, 1024, seed=2)
    x[::2, :2] = 50.0  # a row of 1,024 with two outliers: one level would lose 4.7 % of it (bound: 3 %)
    got = vnni_linear.linear(x, vnni_linear.pack(weight), amx=amx)
    exact = x.double() @ weight.dequantize().double().T  # the weights' own rounding alone
    assert relative_error(got[1::2], reference(x[1::2], weight)) < 1e-5  # plain rows: one level, as the reference
    assert relative_error(got[::2], exact[::2]) < 1e-3 < 1e-2 < relative_error(reference(x[::2], weight), exact[::2])


def silu_glu_float(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, value = (x.double() @ up.double().T).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * value) @ down.double().T


@needs_kernel
def test_a_gated_expert_needs_matching_projections():
    up = vnni_linear.pack(quantize(randn(128, 64, seed=0), INT8))
    with pytest.raises(ValueError, match="gate-up \\(2I, K\\) and down \\(N, I\\) weights of one format"):
        vnni_linear.silu_glu_expert(randn(2, 64, seed=1), up, vnni_linear.pack(quantize(randn(64, 32, seed=2), INT8)))
    with pytest.raises(ValueError, match="gate-up \\(2I, K\\) and down \\(N, I\\) weights of one format"):
        vnni_linear.silu_glu_expert(randn(2, 64, seed=1), up, vnni_linear.pack(quantize(randn(64, 64, seed=2), INT4)))
    with pytest.raises(ValueError, match="VNNI int8 expert"):
        vnni_linear.silu_glu_expert(randn(2, 64, seed=1).half(), up,
                                    vnni_linear.pack(quantize(randn(64, 64, seed=2), INT8)))


@needs_kernel
def test_amx_takes_only_int8():
    with pytest.raises(ValueError, match="AMX kernel cannot run this: it takes int8 weights"):
        vnni_linear.linear(randn(2, 64, seed=0), vnni_linear.pack(quantize(randn(64, 64, seed=1), INT4)), amx=True)


@needs_kernel
@pytest.mark.parametrize("format", FORMATS)
def test_rows_are_read_and_written_through_their_strides_and_nothing_else_is_touched(format):
    q = quantize(randn(64, 64, seed=3), format)
    x = randn(9, 150, seed=4)[:, 11:75]  # (9, 64), row stride 150, rows starting at odd elements
    out_wide = torch.zeros(9, 200)
    out = out_wide[:, 70:134]
    vnni_linear.linear(x, vnni_linear.pack(q), out)
    assert_matches(out, reference(x, q))
    assert not out_wide[:, :70].any() and not out_wide[:, 134:].any()


@needs_kernel
@pytest.mark.parametrize("format", FORMATS)
def test_a_row_of_zeros_gives_zeros_and_no_rows_an_empty_result(format):
    packed = vnni_linear.pack(quantize(randn(64, 64, seed=5), format))
    x = randn(3, 64, seed=6)
    x[1] = 0
    y = vnni_linear.linear(x, packed)
    assert not y[1].any() and y[0].abs().sum() > 0
    assert vnni_linear.linear(torch.zeros(0, 64), packed).shape == (0, 64)


@needs_kernel
@pytest.mark.parametrize("bad", ["float16 rows", "column-strided rows", "wrong width", "out of another dtype"])
def test_inputs_the_kernel_cannot_read_are_refused_before_it_runs(bad):
    packed = vnni_linear.pack(quantize(randn(64, 64, seed=7), INT8))
    x, out = randn(4, 64, seed=8), None
    if bad == "float16 rows":
        x = x.half()
    elif bad == "column-strided rows":
        x = randn(64, 4, seed=8).T
    elif bad == "wrong width":
        x = randn(4, 63, seed=8)
    else:
        out = torch.empty(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="VNNI int8 linear"):
        vnni_linear.linear(x, packed, out)


@pytest.mark.parametrize(("weight", "why"), [
    (quantize(randn(64, 64, seed=9), INT4, group=8), "groups that are a multiple of 16, not 8"),
    (quantize(randn(2, 65540, seed=9), INT8), "at most 65536, not 65540"),
], ids=["int4 groups of 8", "int8 inputs over 65536"])
def test_weights_the_kernel_cannot_take_are_refused_and_left_to_the_other_kernels(weight, why):
    with pytest.raises(ValueError, match=why):
        vnni_linear.pack(weight)
    assert why in unavailable_kernels(weight.format, torch.float32, weight)[OWN[weight.format]]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("format", FORMATS)
def test_the_quantized_linear_runs_the_kernel_into_out(monkeypatch, format, dtype):
    calls = []
    real = vnni_linear.linear

    def counted(x, packed, out=None, *, amx=False):
        calls.append(x.shape[0])
        return real(x, packed, out, amx=amx)

    monkeypatch.setattr(vnni_linear, "linear", counted)
    q = quantize(randn(192, 256, seed=10), format)
    linear = QuantLinear(q, OWN[format], dtype)
    for rows in ROW_COUNTS:
        x = randn(rows, 256, seed=rows).to(dtype)
        out = torch.empty(rows, 192, dtype=dtype)
        assert linear(x, out).data_ptr() == out.data_ptr()
        assert_matches(out, reference(x, q))
    assert calls == list(ROW_COUNTS)


@pytest.fixture
def fresh_build(tmp_path, monkeypatch):
    fresh_process(monkeypatch, tmp_path)
    return tmp_path


@pytest.mark.parametrize(("cpu", "reason"), [(INTEL_MAC, "this CPU lacks AVX512-VNNI"),
                                             (APPLE_SILICON, "the VNNI kernel is for x86-64 CPUs, this is arm64")],
                         ids=lambda value: getattr(value, "name", ""))
def test_without_vnni_the_compiler_is_never_called_and_the_choice_falls_back_to_torchs_kernels(
        fresh_build, monkeypatch, cpu, reason):
    simulate(monkeypatch, cpu)
    build = fake_build(monkeypatch, fresh_build)
    timed = []

    def fake_timing(kernels, gate_up, down, dtype):
        timed.append(tuple(kernels))
        return {kernel: 1e-3 for kernel in kernels}

    monkeypatch.setattr(quant_kernels, "time_kernels", fake_timing)
    assert vnni_linear.unavailable() == reason and vnni_linear.amx_unavailable() == reason
    for format in FORMATS:
        weights = [quantize(randn(64, 64, seed=11), format)]
        assert unavailable_kernels(format, torch.float32, *weights)[OWN[format]] == reason
        choice = choose_kernel(weights, weights, torch.float32)
        assert OWN[format] not in choice.seconds and choice.winner != OWN[format]
    # the AVX2 kernel (test_avx2_linear) is the only one built, where the CPU is x86
    assert [run.rpartition("/")[2] for run in build.runs] == (["avx2_linear.c"] if cpu is INTEL_MAC else [])
    assert all(not {OWN[INT8], OWN[INT4], AMX} & set(kernels) for kernels in timed)


@pytest.mark.parametrize("cpu", [ZEN4, SAPPHIRE_RAPIDS, ICE_LAKE], ids=lambda cpu: cpu.name)
def test_with_vnni_the_kernel_is_built_once_beside_the_bf16_one_under_its_own_name(fresh_build, monkeypatch, cpu):
    simulate(monkeypatch, cpu)
    build = fake_build(monkeypatch, fresh_build)
    assert {vnni_linear.unavailable() for _ in range(3)} == {None}
    (path, content), = build.loaded
    assert path.parent == fresh_build / "kernels" and path.name.startswith("vnni_linear-")
    assert content == b"built by the fake compiler"
    assert len(build.runs) == 1 and build.runs[0].endswith("vnni_linear.c")
    unavailable = unavailable_kernels(INT8, torch.float32, quantize(randn(64, 64, seed=12), INT8))
    assert OWN[INT8] not in unavailable
    # AMX only where the CPU has tiles (and the OS grants them: the fake library's request succeeds)
    assert unavailable.get(AMX) == (None if cpu.amx else "this CPU lacks AMX-INT8 tiles")


def test_a_compiler_that_fails_leaves_the_reason_with_the_quantized_kernels(fresh_build, monkeypatch):
    simulate(monkeypatch, SAPPHIRE_RAPIDS)
    fake_build(monkeypatch, fresh_build, fails=True)
    why = unavailable_kernels(INT4, torch.bfloat16, quantize(randn(64, 64, seed=13), INT4))[OWN[INT4]]
    assert "could not build the VNNI int8/int4 kernel: fake cc: cannot build this" in why
