"""Dispatch and combine for one MoE layer: the engine's hot path.

The router has already chosen (T, k) experts and weights per token on the host. Here the T·k
token-expert assignments are sorted by expert; each accelerator-resident expert's first C
assignments (C = its tier's capacity) are packed into its slice of a fixed (G, C, H) group buffer
and run as one static graph per group; the rest run on the exact CPU path with dynamic shapes:
experts the plan keeps on the CPU ("cold"), and assignments over capacity when the overflow policy
is `spill`. Under `prune` those are dropped instead, the least important first
(importance = router weight × activation norm). Outputs are combined by weighted scatter-add.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

OVERFLOW_POLICIES = ("spill", "prune")

GroupGraph = Callable[[torch.Tensor], torch.Tensor]  # (G, C, H) -> (G, C, H)


@dataclass
class DispatchStats:
    """Counts over planned MoE layer calls. Every assignment lands in exactly one of static, cpu,
    spilled or dropped; slots are the group-buffer rows launched, padding the empty ones."""

    layer_calls: int = 0
    assignments: int = 0
    static: int = 0  # ran inside a group graph
    cpu: int = 0  # ran on the exact CPU path because its expert is cold (or there is no plan)
    spilled: int = 0  # over capacity, ran on the exact CPU path
    dropped: int = 0  # over capacity, pruned
    slots: int = 0
    padding_slots: int = 0
    launches: int = 0  # group graphs run
    expert_launches: int = 0  # graphs one-per-expert execution would have run for the same work

    def to_dict(self) -> dict[str, int | float]:
        """The counts plus the derived fractions (JSON-serialisable)."""
        return {
            **asdict(self),
            "dropped_fraction": self.dropped / self.assignments if self.assignments else 0.0,
            "padding_fraction": self.padding_slots / self.slots if self.slots else 0.0,
        }


@dataclass(frozen=True)
class StaticGroup:
    """One accelerator-resident group: G experts of one tier, run as one (G, C, H) graph."""

    experts: tuple[int, ...]
    capacity: int
    graph: GroupGraph


def expert_ffn(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
               act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """One gated expert on dynamic rows: (n, H) -> (n, 2I) -> (n, I) -> (n, H)."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(act(gate) * up, down)


class MoeLayer:
    """The engine's replacement for one experts module's forward: (T, H) tokens in, (T, H) out."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act: str, *,
                 groups: list[StaticGroup] | None = None, overflow: str = "spill") -> None:
        if overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"overflow must be one of {', '.join(OVERFLOW_POLICIES)}, got {overflow!r}")
        self.gate_up = gate_up  # (E, 2I, H)
        self.down = down  # (E, H, I)
        self.act = ACT2FN[act]
        self.groups = groups or []
        self.overflow = overflow
        self.loads: list[torch.Tensor] | None = None  # when a list, each call appends its (E,) token counts
        self._layout()

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    def _layout(self) -> None:
        """Per-expert lookup tables for packing: every group's buffer lies back to back in one (rows, H)."""
        E, device = self.num_experts, self.gate_up.device
        self.resident = torch.zeros(E, dtype=torch.bool, device=device)
        self.capacity = torch.zeros(E, dtype=torch.long, device=device)
        self.slot_base = torch.zeros(E, dtype=torch.long, device=device)  # first row of the expert's (C, H) slice
        self.group_of = torch.full((E,), -1, dtype=torch.long, device=device)
        self.group_rows: list[slice] = []
        row = 0
        for g, group in enumerate(self.groups):
            ids = torch.tensor(group.experts, dtype=torch.long, device=device)
            if self.resident[ids].any() or ids.unique().numel() != ids.numel():
                raise ValueError(f"group {g}: an expert of {group.experts} is already in a group")
            self.resident[ids] = True
            self.capacity[ids] = group.capacity
            self.group_of[ids] = g
            self.slot_base[ids] = row + torch.arange(len(ids), device=device) * group.capacity
            self.group_rows.append(slice(row, row + len(ids) * group.capacity))
            row += len(ids) * group.capacity
        self.rows = row
        self.group_slots = torch.tensor([r.stop - r.start for r in self.group_rows], dtype=torch.long, device=device)

    def __call__(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 stats: DispatchStats | None = None) -> torch.Tensor:
        """The planned path: group graphs for resident experts, the exact CPU path for the rest."""
        counts = torch.bincount(top_k_index.reshape(-1), minlength=self.num_experts)  # (E,)
        if self.loads is not None:
            self.loads.append(counts.cpu())
        if self.groups:
            y = self._planned(x, top_k_index, top_k_weights, counts)
        else:
            y = self.exact(x, top_k_index, top_k_weights)
        if stats is not None:
            self._count(stats, counts)
        return y

    def exact(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Every assignment on the exact CPU path (decode steps, and layers without a plan)."""
        k = top_k_index.shape[1]
        expert = top_k_index.reshape(-1)  # (S,), S = T·k assignments, token-major
        order = torch.argsort(expert, stable=True)
        y = torch.zeros_like(x)  # (T, H)
        self._exact_into(y, x, order // k, expert[order], top_k_weights.reshape(-1)[order])
        return y

    def _planned(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 counts: torch.Tensor) -> torch.Tensor:
        k = top_k_index.shape[1]
        expert = top_k_index.reshape(-1)  # (S,), S = T·k assignments, token-major
        weight = top_k_weights.reshape(-1)  # (S,)

        # Sort assignments by expert; under prune, the most important first within each expert.
        if self.overflow == "prune":
            importance = weight * x.float().norm(dim=-1).repeat_interleave(k)  # (S,)
            by_importance = torch.argsort(importance, descending=True, stable=True)
            order = by_importance[torch.argsort(expert[by_importance], stable=True)]
        else:
            order = torch.argsort(expert, stable=True)
        expert_s, token_s, weight_s = expert[order], order // k, weight[order]  # (S,) each

        first = torch.cumsum(counts, 0) - counts  # (E,) where each expert's run starts in sorted order
        rank = torch.arange(expert_s.numel(), device=x.device) - first[expert_s]  # (S,) place in its expert's run
        resident = self.resident[expert_s]  # (S,)
        static = resident & (rank < self.capacity[expert_s])  # (S,) fits in the expert's buffer slice

        y = torch.zeros_like(x)  # (T, H)
        self._static_into(y, x, token_s[static], expert_s[static], weight_s[static], rank[static], counts)
        to_cpu = ~resident if self.overflow == "prune" else ~static  # cold experts, plus spills
        self._exact_into(y, x, token_s[to_cpu], expert_s[to_cpu], weight_s[to_cpu])
        return y

    def _static_into(self, y: torch.Tensor, x: torch.Tensor, token: torch.Tensor, expert: torch.Tensor,
                     weight: torch.Tensor, rank: torch.Tensor, counts: torch.Tensor) -> None:
        """Pack into the group buffers, run each group with work as one graph, scatter-add back."""
        H = x.shape[1]
        slots = self.slot_base[expert] + rank  # (N,) buffer row of each static assignment
        packed = x.new_zeros(self.rows, H)  # (rows, H): all groups' (G, C, H) buffers; empty slots stay zero
        packed[slots] = x[token]
        out = torch.empty_like(packed)
        for group, rows, work in zip(self.groups, self.group_rows, self._group_work(counts).tolist(), strict=True):
            if work:
                out[rows] = group.graph(packed[rows].view(len(group.experts), group.capacity, H)).reshape(-1, H)
        y.index_add_(0, token, (out[slots] * weight[:, None]).to(y.dtype))

    def _exact_into(self, y: torch.Tensor, x: torch.Tensor, token: torch.Tensor, expert: torch.Tensor,
                    weight: torch.Tensor) -> None:
        """Exact dynamic-shape expert FFNs on assignments already grouped by expert; scatter-add into y."""
        if token.numel() == 0:
            return
        rows = x[token]  # (N, H), contiguous per expert
        out = torch.empty_like(rows)
        experts, sizes = torch.unique_consecutive(expert, return_counts=True)
        start = 0
        for e, n in zip(experts.tolist(), sizes.tolist(), strict=True):
            out[start:start + n] = expert_ffn(rows[start:start + n], self.gate_up[e], self.down[e], self.act)
            start += n
        y.index_add_(0, token, (out * weight[:, None]).to(y.dtype))

    def _static_per_expert(self, counts: torch.Tensor) -> torch.Tensor:
        """(E,) assignments each expert runs in its group graph."""
        return torch.minimum(counts, self.capacity) * self.resident

    def _group_work(self, counts: torch.Tensor) -> torch.Tensor:
        """(n_groups,) static assignments per group; a group with none is not launched."""
        work = torch.zeros(len(self.groups), dtype=torch.long, device=counts.device)
        return work.index_add_(0, self.group_of[self.resident], self._static_per_expert(counts)[self.resident])

    def _count(self, stats: DispatchStats, counts: torch.Tensor) -> None:
        static = self._static_per_expert(counts)  # (E,)
        over = int(((counts - static) * self.resident).sum())
        launched = self._group_work(counts) > 0  # (n_groups,)
        slots = int(self.group_slots[launched].sum())
        stats.layer_calls += 1
        stats.assignments += int(counts.sum())
        stats.static += int(static.sum())
        stats.cpu += int((counts * ~self.resident).sum())
        stats.spilled += over if self.overflow == "spill" else 0
        stats.dropped += over if self.overflow == "prune" else 0
        stats.slots += slots
        stats.padding_slots += slots - int(static.sum())
        stats.launches += int(launched.sum())
        stats.expert_launches += int((static > 0).sum())
