"""The grouped-expert graph computes one function in two layouts from one set of weights."""

import pytest
import torch

from npumoe.engine.grouped import GroupedExperts, from_ane_layout, to_ane_layout


def random_experts(groups: int, hidden: int, inter: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(groups, 2 * inter, hidden, generator=gen) / hidden**0.5,
            torch.randn(groups, hidden, inter, generator=gen) / inter**0.5)


def test_ane_layout_matches_bmm_layout() -> None:
    gate_up, down = random_experts(groups=4, hidden=32, inter=24)
    x = torch.randn(4, 16, 32)
    reference = GroupedExperts(gate_up, down)(x)
    ane = GroupedExperts(gate_up, down, layout="ane")
    y = from_ane_layout(ane(to_ane_layout(x)), groups=4)
    torch.testing.assert_close(y, reference, rtol=1e-5, atol=1e-5)


def test_ane_layout_splits_wide_projections_without_changing_the_result() -> None:
    gate_up, down = random_experts(groups=5, hidden=16, inter=24)
    x = torch.randn(5, 8, 16)
    narrow = GroupedExperts(gate_up, down, layout="ane", max_channels=48)  # two experts per convolution
    assert narrow.ane_chunks() == [(0, 2), (2, 2), (4, 1)]
    y = from_ane_layout(narrow(to_ane_layout(x)), groups=5)
    torch.testing.assert_close(y, GroupedExperts(gate_up, down)(x), rtol=1e-5, atol=1e-5)


def test_gelu_experts_agree_across_layouts() -> None:
    gate_up, down = random_experts(groups=2, hidden=8, inter=8, seed=1)
    x = torch.randn(2, 4, 8)
    bmm = GroupedExperts(gate_up, down, act="gelu")(x)
    ane = GroupedExperts(gate_up, down, act="gelu", layout="ane")(to_ane_layout(x))
    torch.testing.assert_close(from_ane_layout(ane, groups=2), bmm, rtol=1e-5, atol=1e-5)


def test_ane_layout_places_each_experts_tokens_in_its_channel_block() -> None:
    x = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)  # (G, C, H)
    packed = to_ane_layout(x)
    assert packed.shape == (1, 8, 1, 3)
    assert torch.equal(packed[0, 4:8, 0, :], x[1].T)  # expert 1, its 3 tokens over hidden channels 4..7
    assert torch.equal(from_ane_layout(packed, groups=2), x)


def test_unknown_layout_is_rejected_by_name() -> None:
    gate_up, down = random_experts(groups=1, hidden=4, inter=4)
    with pytest.raises(ValueError, match="layout 'nchw'"):
        GroupedExperts(gate_up, down, layout="nchw")
