"""The grouped-expert graph: G expert FFNs of one tier run as one static graph.

This module is the single source of every static expert graph: the `torch-static`
executor runs it, the CUDA executor captures it, and coremltools converts it. Its
shapes are fixed at construction, and it holds no routing, gather or scatter: the
host packs each expert's tokens into a contiguous (C, H) slice before the call.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN


class GroupedExperts(nn.Module):
    """G gated expert FFNs, (G, C, H) -> (G, C, H), in transformers' fused layout.

    gate_up: (G, 2I, H), the gate rows first, then the up rows (as transformers 5 stores them).
    down:    (G, H, I).
    """

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act: str = "silu") -> None:
        super().__init__()
        if gate_up.ndim != 3 or down.ndim != 3 or gate_up.shape[0] != down.shape[0]:
            raise ValueError(f"expected (G, 2I, H) and (G, H, I) weights, got {tuple(gate_up.shape)} "
                             f"and {tuple(down.shape)}")
        self.gate_up = nn.Parameter(gate_up, requires_grad=False)
        self.down = nn.Parameter(down, requires_grad=False)
        self.act_name = act
        self.act = ACT2FN[act]

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
        # x: (G, C, H) -> (G, C, 2I) -> (G, C, I) -> (G, C, H)
        gate, up = torch.bmm(x, self.gate_up.transpose(1, 2)).chunk(2, dim=-1)
        return torch.bmm(self.act(gate) * up, self.down.transpose(1, 2))
