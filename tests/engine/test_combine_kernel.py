"""The engine's combine kernel gives each token the weighted sum of its experts' outputs that torch's combine
gives (both sum in float32 and round once, so they differ only by summation order: in bf16 by one unit in the
last place on a few elements), for every dtype pair it
takes, on one worker or several; whatever it cannot take is combined by torch."""

from __future__ import annotations

import pytest
import torch

from npumoe.engine.kernels import combine_kernel
from npumoe.engine.moe import dispatch

_WHY = combine_kernel.unavailable()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"the combine kernel cannot be built here: {_WHY}")


def _case(tokens: int, k: int, hidden: int, dtype: torch.dtype, weight_dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    out = torch.randn(tokens * k, hidden, generator=generator).to(dtype)
    order = torch.randperm(tokens * k, generator=generator)
    weights = torch.rand(tokens, k, generator=generator).to(weight_dtype)
    return out, order, weights


def _torch_combine(monkeypatch: pytest.MonkeyPatch, *args: torch.Tensor) -> torch.Tensor:
    with monkeypatch.context() as patch:
        patch.setattr(combine_kernel, "supports", lambda *_: False)
        return dispatch.combine(*args)


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Tokens combined by the kernel, one entry per dispatch.combine that used it."""
    calls: list[int] = []
    real = combine_kernel.combine

    def counted(out: torch.Tensor, at: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        calls.append(top_k_weights.shape[0])
        return real(out, at, top_k_weights)

    monkeypatch.setattr(combine_kernel, "combine", counted)
    return calls


@pytest.mark.parametrize(("dtype", "weight_dtype"), [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                     (torch.float32, torch.float32), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize(("tokens", "k", "hidden"), [(512, 8, 256), (37, 2, 72), (1, 4, 100)])
def test_the_kernel_combines_as_torch_does(monkeypatch, kernel_calls, dtype, weight_dtype, tokens, k, hidden):
    out, order, weights = _case(tokens, k, hidden, dtype, weight_dtype)
    expected = _torch_combine(monkeypatch, out, order, weights)
    got = dispatch.combine(out, order, weights)
    assert kernel_calls == [tokens]
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got, expected, rtol=2**-7, atol=0)  # a unit in the last place at most
        assert (got != expected).float().mean() < 1e-3
    else:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_rows_are_split_over_workers_with_the_same_result(monkeypatch, kernel_calls):
    out, order, weights = _case(300, 8, 128, torch.bfloat16, torch.float32, seed=1)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = dispatch.combine(out, order, weights)
        torch.set_num_threads(2)
        split = dispatch.combine(out, order, weights)
    finally:
        torch.set_num_threads(previous)
    assert kernel_calls == [300, 300]
    torch.testing.assert_close(split, alone, rtol=0, atol=0)


def test_nan_outputs_stay_nan(kernel_calls):
    out, order, weights = _case(4, 2, 64, torch.bfloat16, torch.float32)
    out[order[0], 5] = float("nan")
    got = dispatch.combine(out, order, weights)
    assert kernel_calls == [4]
    assert torch.isnan(got[0, 5]) and torch.isfinite(got).sum() == got.numel() - 1


@pytest.mark.parametrize("what", ["float16 outputs", "float64 weights", "strided outputs"])
def test_what_the_kernel_does_not_take_torch_combines(kernel_calls, what):
    out, order, weights = _case(16, 4, 64, torch.float16 if what == "float16 outputs" else torch.float32,
                                torch.float64 if what == "float64 weights" else torch.float32)
    if what == "strided outputs":
        out = torch.cat([out, out], dim=1)[:, ::2]
    got = dispatch.combine(out, order, weights)
    assert kernel_calls == []
    by_token = out[torch.argsort(order)].double().view(16, 4, -1)
    expected = (weights.double().unsqueeze(-1) * by_token).sum(1)
    torch.testing.assert_close(got.double(), expected, rtol=2e-3, atol=2e-3)


def test_the_kernel_refuses_indices_of_the_wrong_shape():
    out, order, weights = _case(4, 2, 64, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="int64 row indices"):
        combine_kernel.combine(out, order[:-1], weights)
