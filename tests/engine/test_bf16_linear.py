"""The engine's bf16 matmul kernel: its packed layout, its results against float64, and how it says no."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from npumoe.engine import bf16_linear

needs_kernel = pytest.mark.skipif(bf16_linear.unavailable() is not None,
                                  reason=f"no bf16 kernel here: {bf16_linear.unavailable()}")


def bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x · wᵀ in float64, rounded once to bf16: what float32 accumulation should come within a rounding of."""
    return (x.double() @ w.double().T).to(torch.bfloat16)


def test_a_packed_block_holds_64_output_columns_with_each_k_pair_side_by_side():
    w = bf16(128, 6, seed=0)
    packed = bf16_linear.pack(w)
    assert packed.shape == (2, 3, 64, 2)
    for block, pair, column in ((0, 0, 0), (1, 2, 63), (1, 1, 5)):
        assert torch.equal(packed[block, pair, column], w[block * 64 + column, 2 * pair:2 * pair + 2])


@pytest.mark.parametrize(("n", "k"), [(48, 64), (64, 63), (0, 64)])
def test_shapes_outside_whole_blocks_and_k_pairs_are_refused(n, k):
    assert not bf16_linear.supports(n, k)
    with pytest.raises(ValueError, match="N % 64 == 0 and K even"):
        bf16_linear.pack(bf16(n, k, seed=0))


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 8, 13, 37])
@pytest.mark.parametrize(("n", "k"), [(64, 64), (192, 96), (128, 2050)])
def test_every_row_count_and_shape_is_within_a_bf16_rounding_of_float64(rows, n, k):
    x, w = bf16(rows, k, seed=1), bf16(n, k, seed=2)
    y = bf16_linear.linear(x, bf16_linear.pack(w))
    # float32 sums in another order than float64: at most a rounding step of bf16 apart (2^-8 relative)
    torch.testing.assert_close(y.float(), reference(x, w).float(), rtol=2**-7, atol=1e-2)


@needs_kernel
def test_rows_are_read_and_written_through_their_strides_and_nothing_else_is_touched():
    x_wide, w = bf16(9, 100, seed=3), bf16(64, 32, seed=4)
    x = x_wide[:, 11:43]  # (9, 32), row stride 100, rows starting at odd elements
    out_wide = torch.zeros(9, 200, dtype=torch.bfloat16)
    out = out_wide[:, 70:134]  # (9, 64), row stride 200
    assert bf16_linear.linear(x, bf16_linear.pack(w), out).data_ptr() == out.data_ptr()
    torch.testing.assert_close(out.float(), reference(x, w).float(), rtol=2**-7, atol=1e-2)
    assert not out_wide[:, :70].any() and not out_wide[:, 134:].any()


@needs_kernel
def test_no_rows_give_an_empty_result():
    assert bf16_linear.linear(bf16(0, 64, seed=0), bf16_linear.pack(bf16(64, 64, seed=1))).shape == (0, 64)


@needs_kernel
@pytest.mark.parametrize("bad", ["float32 rows", "column-strided rows", "wrong out shape"])
def test_inputs_the_kernel_cannot_read_are_refused_before_it_runs(bad):
    x, packed = bf16(4, 64, seed=0), bf16_linear.pack(bf16(64, 64, seed=1))
    out = None
    if bad == "float32 rows":
        x = x.float()
    elif bad == "column-strided rows":
        x = bf16(64, 4, seed=0).T
    else:
        out = torch.empty(4, 65, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bf16 linear"):
        bf16_linear.linear(x, packed, out)


@pytest.fixture
def fresh_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty kernel cache and no loaded library, put back afterwards."""
    monkeypatch.setenv("NPUMOE_CACHE", str(tmp_path))
    bf16_linear._library.cache_clear()
    yield tmp_path
    bf16_linear._library.cache_clear()


@pytest.mark.skipif(bf16_linear.unavailable() is not None, reason="builds only where the kernel does")
def test_the_kernel_is_built_once_into_the_cache_under_its_source_hash(fresh_build):
    assert bf16_linear.unavailable() is None
    built = list((fresh_build / "kernels").iterdir())
    assert len(built) == 1 and built[0].name.startswith("bf16_linear-") and built[0].suffix == ".so"
    bf16_linear._library.cache_clear()
    stamp = built[0].stat().st_mtime_ns
    assert bf16_linear.unavailable() is None
    assert built[0].stat().st_mtime_ns == stamp  # loaded again, not rebuilt


def test_a_compiler_that_fails_leaves_a_reason_and_no_partial_library(fresh_build, monkeypatch):
    monkeypatch.setenv("CC", "false")
    reason = bf16_linear.unavailable()
    assert reason is not None
    assert "could not build" in reason or "x86-64" in reason  # off x86 it never gets as far as the compiler
    assert not list(fresh_build.rglob("*.so"))
