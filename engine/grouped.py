"""The grouped-expert graph: G expert FFNs of one tier run as one static graph.

This module is the single source of every static expert graph: the `torch-static`
executor runs it, the CUDA executor captures it, and coremltools converts it. Its
shapes are fixed at construction, and it holds no routing, gather or scatter: the
host packs each expert's tokens into a contiguous (C, H) slice before the call.

Two layouts compute the same function from the same weights:
- "bmm": x (G, C, H) -> (G, C, H), two batched matmuls (torch and CUDA graphs);
- "ane": x (1, G*H, 1, C) -> (1, G*H, 1, C), the (B, C, 1, S) layout of Apple's
  ml-ane-transformers, where each projection is one grouped 1x1 convolution (groups=G),
  which is how the Neural Engine runs a linear layer fast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

LAYOUTS = ("bmm", "ane")

# The Neural Engine's widest channel axis (ANEMLL's ANE implementation notes, "Tensor Shape
# Constraints": channels <= 65,536). Wider projections are split into several convolutions.
ANE_MAX_CHANNELS = 65536


class GroupedExperts(nn.Module):
    """G gated expert FFNs in transformers' fused layout, run in the chosen layout.

    gate_up: (G, 2I, H), the gate rows first, then the up rows (as transformers 5 stores them).
    down:    (G, H, I).
    """

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act: str = "silu",
                 layout: str = "bmm", max_channels: int = ANE_MAX_CHANNELS) -> None:
        super().__init__()
        if gate_up.ndim != 3 or down.ndim != 3 or gate_up.shape[0] != down.shape[0]:
            raise ValueError(f"expected (G, 2I, H) and (G, H, I) weights, got {tuple(gate_up.shape)} "
                             f"and {tuple(down.shape)}")
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
        self.gate_up = nn.Parameter(gate_up, requires_grad=False)
        self.down = nn.Parameter(down, requires_grad=False)
        self.act_name = act
        self.act = ACT2FN[act]
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
        # x: (G, C, H) -> (G, C, 2I) -> (G, C, I) -> (G, C, H)
        gate, up = torch.bmm(x, self.gate_up.transpose(1, 2)).chunk(2, dim=-1)
        return torch.bmm(self.act(gate) * up, self.down.transpose(1, 2))

    def _forward_ane(self, x: torch.Tensor) -> torch.Tensor:
        # x: (1, G*H, 1, C); channel block g holds expert g's tokens. Experts are cut into
        # chunks whose convolutions stay under the channel limit; usually there is one chunk.
        hidden, inter = self.hidden_size, self.intermediate_size
        outputs = []
        for first, count in self.ane_chunks():
            gate_up = self.gate_up[first:first + count]
            x_chunk = x[:, first * hidden:(first + count) * hidden] if count < self.group_size else x
            gate = F.conv2d(x_chunk, gate_up[:, :inter].reshape(count * inter, hidden, 1, 1), groups=count)
            up = F.conv2d(x_chunk, gate_up[:, inter:].reshape(count * inter, hidden, 1, 1), groups=count)
            down = self.down[first:first + count].reshape(count * hidden, inter, 1, 1)
            outputs.append(F.conv2d(self.act(gate) * up, down, groups=count))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    def ane_chunks(self) -> list[tuple[int, int]]:
        """(first expert, expert count) of each convolution chunk of the ANE layout."""
        per_chunk = max(1, self.max_channels // max(self.hidden_size, self.intermediate_size))
        return [(first, min(per_chunk, self.group_size - first))
                for first in range(0, self.group_size, per_chunk)]


def to_ane_layout(x: torch.Tensor) -> torch.Tensor:
    """(G, C, H) token slices -> (1, G*H, 1, C), the ANE layout's input."""
    groups, capacity, hidden = x.shape
    return x.transpose(1, 2).reshape(1, groups * hidden, 1, capacity)


def from_ane_layout(y: torch.Tensor, groups: int) -> torch.Tensor:
    """(1, G*H, 1, C) -> (G, C, H), inverting `to_ane_layout`."""
    _, channels, _, capacity = y.shape
    return y.reshape(groups, channels // groups, capacity).transpose(1, 2)
