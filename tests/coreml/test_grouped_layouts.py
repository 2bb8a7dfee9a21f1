"""The grouped-expert graph computes one function in two tensor layouts from one set of weights, for every
experts layout the engine implements; and those layouts convert to Core ML (which runs on Linux too)."""

import pytest
import torch

from npumoe.engine.backends.coreml.ane import ane_problems
from npumoe.engine.backends.coreml.convert import ConversionError, convert_group
from npumoe.engine.moe.cpu_experts import CpuExperts
from npumoe.engine.moe.experts_layout import (
    CLAMPED_GLU,
    CLAMPED_SWIGLU,
    COREML_ACTIVATIONS,
    ExpertsLayout,
    ExpertWeights,
)
from npumoe.engine.moe.grouped import GroupedExperts, from_ane_layout, to_ane_layout

# One of each kind the engine implements: transformers' default, another activation, gpt-oss's clamped SwiGLU
# with biases, DeepSeek-V4's clamped GLU, and Nemotron-H's experts without a gate.
LAYOUTS = {
    "silu-glu": ExpertsLayout(),
    "gelu-glu": ExpertsLayout(activation="gelu"),
    "clamped-swiglu+bias": ExpertsLayout(activation=None, gate=CLAMPED_SWIGLU, alpha=1.702, limit=1.0, bias=True),
    "clamped-glu": ExpertsLayout(gate=CLAMPED_GLU, limit=1.0),
    "relu2-not-gated": ExpertsLayout(activation="relu2", gate=None),
}


def random_experts(groups: int, hidden: int, inter: int, layout: ExpertsLayout = LAYOUTS["silu-glu"],
                   seed: int = 0) -> ExpertWeights:
    gen = torch.Generator().manual_seed(seed)
    rows = layout.projections * inter
    biases = (torch.randn(groups, rows, generator=gen), torch.randn(groups, hidden, generator=gen)) if layout.bias \
        else (None, None)
    return ExpertWeights(torch.randn(groups, rows, hidden, generator=gen) / hidden**0.5,
                         torch.randn(groups, hidden, inter, generator=gen) / inter**0.5, *biases)


def one_by_one(weights: ExpertWeights, layout: ExpertsLayout, x: torch.Tensor) -> torch.Tensor:
    """Each expert's rows through the exact CPU path: what a group graph must equal."""
    experts = CpuExperts(weights, layout)
    return torch.stack([experts(g, x[g]) for g in range(len(weights))])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_both_tensor_layouts_compute_the_cpu_experts_function(name: str) -> None:
    layout = LAYOUTS[name]
    weights = random_experts(groups=4, hidden=32, inter=24, layout=layout)
    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(1)) * 2  # reaching past the clamps
    reference = one_by_one(weights, layout, x)
    torch.testing.assert_close(GroupedExperts(weights, layout)(x), reference, rtol=1e-5, atol=1e-5)
    ane = GroupedExperts(weights, layout, layout="ane")
    torch.testing.assert_close(from_ane_layout(ane(to_ane_layout(x)), groups=4), reference, rtol=1e-5, atol=1e-5)


def test_ane_layout_splits_wide_projections_without_changing_the_result() -> None:
    layout = LAYOUTS["clamped-swiglu+bias"]
    weights = random_experts(groups=5, hidden=16, inter=24, layout=layout)
    x = torch.randn(5, 8, 16)
    narrow = GroupedExperts(weights, layout, layout="ane", max_channels=48)  # two experts per convolution
    assert narrow.ane_chunks() == [(0, 2), (2, 2), (4, 1)]
    y = from_ane_layout(narrow(to_ane_layout(x)), groups=5)
    torch.testing.assert_close(y, GroupedExperts(weights, layout)(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_implemented_layout_converts_to_a_core_ml_graph_the_neural_engine_runs_whole(name: str) -> None:
    layout = LAYOUTS[name]
    program = convert_group(random_experts(groups=2, hidden=16, inter=8, layout=layout), layout, capacity=4)
    function = program._get_mil_internal().functions["main"]
    op_types = [op.op_type for op in function.operations]
    assert op_types.count("conv") == layout.projections + 1  # gate and up (or up alone), then down
    assert ane_problems(function) == []


@pytest.mark.parametrize("act", sorted(COREML_ACTIVATIONS))
def test_every_activation_the_engine_sends_to_core_ml_converts_to_ops_the_neural_engine_runs(act: str) -> None:
    layout = ExpertsLayout(activation=act)
    program = convert_group(random_experts(groups=2, hidden=16, inter=8), layout, capacity=4)
    assert ane_problems(program._get_mil_internal().functions["main"]) == []


def test_a_layout_core_ml_is_not_checked_for_is_refused_with_the_reason() -> None:
    layout = ExpertsLayout(activation="laplace")
    assert "laplace" in layout.coreml_problem()
    with pytest.raises(ConversionError, match="stay on the CPU: the laplace activation"):
        convert_group(random_experts(groups=1, hidden=8, inter=4), layout, capacity=4)


def test_ane_layout_places_each_experts_tokens_in_its_channel_block() -> None:
    x = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)  # (G, C, H)
    packed = to_ane_layout(x)
    assert packed.shape == (1, 8, 1, 3)
    assert torch.equal(packed[0, 4:8, 0, :], x[1].T)  # expert 1, its 3 tokens over hidden channels 4..7
    assert torch.equal(from_ane_layout(packed, groups=2), x)


def test_unknown_layout_is_rejected_by_name() -> None:
    with pytest.raises(ValueError, match="layout 'nchw'"):
        GroupedExperts(random_experts(groups=1, hidden=4, inter=4), layout="nchw")


def test_weights_that_do_not_fit_the_layout_are_rejected() -> None:
    weights = random_experts(groups=1, hidden=8, inter=4)  # gate and up rows
    with pytest.raises(ValueError, match="does not fit"):
        GroupedExperts(weights, LAYOUTS["relu2-not-gated"])
