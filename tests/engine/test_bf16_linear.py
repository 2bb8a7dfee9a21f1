"""The engine's bf16 matmul kernel: its packed layout, its results against float64, and how it says no."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest
import torch
from support.cpus import APPLE_SILICON, ICE_LAKE, INTEL_MAC, SAPPHIRE_RAPIDS, ZEN4, fake_build, fresh_process, simulate

from npumoe.engine.kernels import bf16_linear

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
def fresh_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty kernel cache and nothing built or tried in this process, for the test's span."""
    fresh_process(monkeypatch, tmp_path)
    return tmp_path


@pytest.mark.skipif(bf16_linear.unavailable() is not None, reason="builds only where the kernel does")
def test_the_kernel_is_built_once_into_a_private_cache_under_its_source_hash_with_its_content_hash(fresh_build,
                                                                                                   monkeypatch):
    assert bf16_linear.unavailable() is None
    folder = fresh_build / "kernels"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    library, = folder.glob("*.so")
    assert library.name.startswith("bf16_linear-")
    assert (folder / f"{library.name}.sha256").read_text() == hashlib.sha256(library.read_bytes()).hexdigest()
    stamp = library.stat().st_mtime_ns
    fresh_process(monkeypatch)
    assert bf16_linear.unavailable() is None
    assert library.stat().st_mtime_ns == stamp  # loaded again, not rebuilt


@pytest.mark.parametrize("cpu", [ZEN4, SAPPHIRE_RAPIDS], ids=lambda cpu: cpu.name)
def test_a_compiler_that_fails_is_run_once_and_leaves_a_reason_and_no_library(fresh_build, monkeypatch, cpu):
    simulate(monkeypatch, cpu)
    build = fake_build(monkeypatch, fresh_build, fails=True)
    reasons = {bf16_linear.unavailable() for _ in range(3)}
    assert len(reasons) == 1 and "could not build the bf16 kernel: fake cc: cannot build this" in reasons.pop()
    assert len(build.runs) == 1  # tried once per process, not once per experts module
    with pytest.raises(OSError, match="could not build"):
        bf16_linear.linear(bf16(1, 64, seed=0), bf16_linear.pack(bf16(64, 64, seed=1)))
    assert not list(fresh_build.rglob("*.so")) and not build.loaded


@pytest.mark.parametrize(("cpu", "reason"), [(ICE_LAKE, "lacks AVX512-BF16"), (INTEL_MAC, "lacks AVX512-BF16"),
                                             (APPLE_SILICON, "for x86-64 CPUs, this is arm64")],
                         ids=lambda value: getattr(value, "name", ""))
def test_a_cpu_that_cannot_run_the_kernel_never_calls_the_compiler(fresh_build, monkeypatch, cpu, reason):
    simulate(monkeypatch, cpu)
    build = fake_build(monkeypatch, fresh_build)
    assert reason in bf16_linear.unavailable()
    assert build.runs == [] and build.loaded == []


def test_cc_may_be_a_command_with_arguments(fresh_build, monkeypatch):
    simulate(monkeypatch, ZEN4)
    build = fake_build(monkeypatch, fresh_build)
    monkeypatch.setenv("CC", f"{os.environ['CC']} --as-ccache-would")
    assert bf16_linear.unavailable() is None
    assert build.runs[0].startswith("--as-ccache-would -O3")
    (path, content), = build.loaded
    assert path.parent == fresh_build / "kernels" and content == b"built by the fake compiler"


@pytest.mark.parametrize("flaw", ["group-writable", "writable by others", "someone else's"])
def test_a_library_planted_in_a_cache_others_can_write_to_is_not_loaded(fresh_build, monkeypatch, flaw):
    simulate(monkeypatch, SAPPHIRE_RAPIDS)
    build = fake_build(monkeypatch, fresh_build)
    assert bf16_linear.unavailable() is None
    (built, _), = build.loaded
    # Whoever can write to the folder replaces the library and its recorded hash alike.
    built.write_bytes(b"planted")
    (built.parent / f"{built.name}.sha256").write_text(hashlib.sha256(b"planted").hexdigest())
    if flaw == "someone else's":
        monkeypatch.setattr(os, "getuid", lambda: built.parent.stat().st_uid + 1)
    else:
        built.parent.chmod(0o770 if flaw == "group-writable" else 0o707)
    fresh_process(monkeypatch)
    with pytest.warns(RuntimeWarning, match="kernel cache .* is not safe to load code from: .*private temporary"):
        assert bf16_linear.unavailable() is None
    path, content = build.loaded[-1]
    assert content == b"built by the fake compiler" and not path.is_relative_to(fresh_build)
    assert not path.exists()  # the private folder is gone once the library is loaded


def test_a_cache_inside_a_folder_others_can_write_to_is_not_loaded_from(fresh_build, monkeypatch):
    simulate(monkeypatch, SAPPHIRE_RAPIDS)
    shared = fresh_build / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # whoever can write here can swap the private `npumoe` folder below for their own
    fresh_process(monkeypatch, shared / "npumoe")
    build = fake_build(monkeypatch, fresh_build)
    with pytest.warns(RuntimeWarning, match=f"not safe to load code from: others can write to {shared} "):
        assert bf16_linear.unavailable() is None
    path, _ = build.loaded[-1]
    assert not path.is_relative_to(shared)


def test_a_cached_library_whose_content_does_not_match_its_hash_is_not_loaded(fresh_build, monkeypatch):
    simulate(monkeypatch, ZEN4)
    build = fake_build(monkeypatch, fresh_build)
    assert bf16_linear.unavailable() is None
    (built, _), = build.loaded
    built.write_bytes(b"planted")  # the recorded hash is the build's
    fresh_process(monkeypatch)
    assert bf16_linear.unavailable() is None
    assert build.loaded[-1] == (built, b"built by the fake compiler")  # built again before it was loaded
    assert len(build.runs) == 2
