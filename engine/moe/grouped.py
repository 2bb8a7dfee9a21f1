"""The grouped-expert graph: G expert FFNs of one tier run as one static graph.

This module is the single source of every static expert graph: coremltools converts `GroupedExperts`, and the
`torch-static` executor measures it; in a run, torch-static computes a placed group as `PackedGroup`, the same
static contract over the packed copy of the weights the CPU path reads, so they exist once (in the run's format).
Shapes are fixed at construction, and neither holds routing, gather or scatter: the host packs each expert's
tokens into a contiguous (C, H) slice before the call.

Each expert's FFN is the one its module's `ExpertsLayout` describes (experts_layout.py): input projection,
bias, gate or activation, down projection, bias. Two tensor layouts compute the same function from the
same weights:
- "bmm": x (G, C, H) -> (G, C, H), two batched matmuls (torch);
- "ane": x (1, G*H, 1, C) -> (1, G*H, 1, C), the (B, C, 1, S) layout of Apple's
  ml-ane-transformers, where each projection is one grouped 1x1 convolution (groups=G),
  which is how the Neural Engine runs a linear layer fast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.workers import run_tasks
from .cpu_experts import CpuExperts
from .experts_layout import DEFAULT_LAYOUT, ExpertsLayout, ExpertWeights

LAYOUTS = ("bmm", "ane")

# The Neural Engine's widest channel axis (ANEMLL's ANE implementation notes, "Tensor Shape
# Constraints": channels <= 65,536). Wider projections are split into several convolutions.
ANE_MAX_CHANNELS = 65536


class GroupedExperts(nn.Module):
    """G expert FFNs of one experts layout, run in the chosen tensor layout ("bmm" or "ane").

    weights: the G experts' `ExpertWeights`: gate_up (G, n·I, H) with the gate rows first, down (G, H, I),
    and their biases where the layout has them.
    """

    def __init__(self, weights: ExpertWeights, experts_layout: ExpertsLayout = DEFAULT_LAYOUT,
                 layout: str = "bmm", max_channels: int = ANE_MAX_CHANNELS) -> None:
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
        if weights.gate_up.shape[1] != experts_layout.projections * weights.ffn:
            raise ValueError(f"gate_up {tuple(weights.gate_up.shape)} does not fit down {tuple(weights.down.shape)} "
                             f"for {experts_layout.describe()}")
        self.gate_up = nn.Parameter(weights.gate_up.detach(), requires_grad=False)
        self.down = nn.Parameter(weights.down.detach(), requires_grad=False)
        biases = (weights.gate_up_bias, weights.down_bias)
        self.gate_up_bias, self.down_bias = (None if b is None else nn.Parameter(b.detach(), requires_grad=False)
                                             for b in biases)
        self.experts_layout = experts_layout
        self.layout = layout
        self.max_channels = max_channels  # per convolution, in the "ane" layout

    @property
    def group_size(self) -> int:
        return self.gate_up.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.gate_up.shape[2]

    @property
    def intermediate_size(self) -> int:
        return self.down.shape[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward_ane(x) if self.layout == "ane" else self._forward_bmm(x)

    def _forward_bmm(self, x: torch.Tensor) -> torch.Tensor:
        # x: (G, C, H) -> (G, C, n·I) -> (G, C, I) -> (G, C, H)
        h = torch.bmm(x, self.gate_up.transpose(1, 2))
        if self.gate_up_bias is not None:
            h = h + self.gate_up_bias[:, None]
        y = torch.bmm(self.experts_layout.apply(h), self.down.transpose(1, 2))
        return y + self.down_bias[:, None] if self.down_bias is not None else y

    def _forward_ane(self, x: torch.Tensor) -> torch.Tensor:
        # x: (1, G*H, 1, C); channel block g holds expert g's tokens. Experts are cut into
        # chunks whose convolutions stay under the channel limit; usually there is one chunk.
        hidden, inter = self.hidden_size, self.intermediate_size
        # the input projection's parts, one convolution each: the gate and up rows when gated, else all (the up rows)
        parts = (slice(0, inter), slice(inter, 2 * inter)) if self.experts_layout.gate else (None,)
        outputs = []
        for first, count in self.ane_chunks():
            experts = slice(first, first + count)
            x_chunk = x[:, first * hidden:(first + count) * hidden] if count < self.group_size else x
            projected = [_grouped_conv(x_chunk, _part(self.gate_up, experts, rows),
                                       _part(self.gate_up_bias, experts, rows)) for rows in parts]
            gate, up = projected if len(projected) == 2 else (None, projected[0])
            a = self.experts_layout.activate(gate, up)
            outputs.append(_grouped_conv(a, _part(self.down, experts), _part(self.down_bias, experts)))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    def ane_chunks(self) -> list[tuple[int, int]]:
        """(first expert, expert count) of each convolution chunk of the ANE layout."""
        per_chunk = max(1, self.max_channels // max(self.hidden_size, self.intermediate_size))
        return [(first, min(per_chunk, self.group_size - first))
                for first in range(0, self.group_size, per_chunk)]


class PackedGroup:
    """G experts' (G, C, H) -> (G, C, H) graph computed by the CPU's packed copy of their weights (`CpuExperts`,
    in the run's format): each expert's C rows, padding included, through its FFN, as a fixed-shape graph computes
    them, the experts side by side on the workers. A group placed this way reads the weights the CPU path reads
    for its spills: they exist once, not again as the group's float copy."""

    def __init__(self, experts: CpuExperts, ids: tuple[int, ...]) -> None:
        self.experts, self.ids = experts, ids
        self.calls = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out = torch.empty_like(x)
        run_tasks([lambda g=g, e=e: self.experts(e, x[g], out[g]) for g, e in enumerate(self.ids)])
        return out


def _grouped_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """(1, G*in, 1, C) through G experts' (G, out, in) projections (and (G, out) biases) as one grouped 1x1
    convolution -> (1, G*out, 1, C)."""
    groups, out, inputs = weight.shape
    return F.conv2d(x, weight.reshape(groups * out, inputs, 1, 1), None if bias is None else bias.reshape(-1),
                    groups=groups)


def _part(weight: torch.Tensor | None, experts: slice, rows: slice | None = None) -> torch.Tensor | None:
    """These experts' weights (or biases), only `rows` of each when given. A slice spanning a whole axis is left
    out: torch.export turns it into an alias, which coremltools does not convert."""
    if weight is None:
        return None
    part = weight[experts] if experts != slice(0, len(weight)) else weight
    return part[:, rows] if rows is not None else part


def to_ane_layout(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """(G, C, H) token slices -> (1, G*H, 1, C), the ANE layout's input, in `dtype` (default x's): one copy."""
    groups, capacity, hidden = x.shape
    ane = torch.empty(groups, hidden, capacity, dtype=dtype or x.dtype, device=x.device).copy_(x.transpose(1, 2))
    return ane.view(1, groups * hidden, 1, capacity)


def from_ane_layout(y: torch.Tensor, groups: int) -> torch.Tensor:
    """(1, G*H, 1, C) -> (G, C, H), inverting `to_ane_layout`."""
    _, channels, _, capacity = y.shape
    return y.reshape(groups, channels // groups, capacity).transpose(1, 2)
