"""Dispatch and combine for one MoE layer: the engine's hot path.

The router has already chosen (T, k) experts and weights per token on the host. Here the S = T·k
token-expert assignments are sorted by expert once; each expert's assignments are then one slice
of that order. Each accelerator-resident expert's first C assignments (C = its tier's capacity) are
packed into its slice of a fixed (G, C, H) group buffer and run as one static graph per group; the
rest run on the exact CPU path with dynamic shapes: experts the plan keeps on the CPU ("cold"), and
assignments over capacity when the overflow policy is `spill`. Under `prune` those are dropped
instead, the least important first (importance = router weight × activation norm). The group graphs
are submitted to the backend before the CPU work starts, so a backend with a device of its own
overlaps the two. Every assignment's expert output lands in its row of one (S, H) buffer in sorted
order (an expert's rows are one contiguous slice); where the experts layout has a post-expert norm it
normalises that buffer's rows once, whichever path made them; and the combine gathers each token's k
rows once and takes their weighted sum.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from itertools import accumulate

import torch

from ..kernels import combine_kernel
from ..kernels.workers import Task, run_tasks
from ..vocabulary import OVERFLOW_POLICIES, PRUNE, SPILL
from .cpu_experts import CpuExperts
from .experts_layout import DEFAULT_LAYOUT, ExpertsLayout, ExpertWeights

GroupGraph = Callable[[torch.Tensor], torch.Tensor]  # (G, C, H) -> (G, C, H)
PostNorm = Callable[[torch.Tensor], torch.Tensor]  # (S, H) expert outputs -> normalised (S, H)
GraphCalls = Sequence[tuple[GroupGraph, torch.Tensor]]
Submit = Callable[[GraphCalls], Future[list[torch.Tensor]]]


def run_now(calls: GraphCalls) -> Future[list[torch.Tensor]]:
    """Run group graphs in the caller's thread, in order; the future is already done."""
    future: Future[list[torch.Tensor]] = Future()
    future.set_result([graph(x) for graph, x in calls])
    return future


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


class Workspace(threading.local):
    """Buffers a thread reuses from one layer call to the next. A fresh (S, H) buffer per call costs a page
    fault per 4 KiB touched (the C allocator maps blocks this large anew each time): about a tenth of a
    512-token layer call. Each thread holds its largest buffers until it ends."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, rows: int, like: torch.Tensor, *, finite: bool = False) -> torch.Tensor:
        """An uninitialised (rows, H) tensor of `like`'s dtype and device, H = like.shape[1]. `finite`: rows never
        written hold zeros or what earlier calls wrote, never the allocator's garbage (a NaN or a subnormal there
        could slow a graph down): the buffer is zeroed once, when it is made."""
        buffer = self.buffers.get(name)
        if (buffer is None or buffer.shape[0] < rows or buffer.shape[1] != like.shape[1]
                or buffer.dtype != like.dtype or buffer.device != like.device):
            with torch.inference_mode(False):  # a normal tensor, writable in and out of inference mode
                make = like.new_zeros if finite else like.new_empty
                buffer = self.buffers[name] = make(rows, like.shape[1])
        return buffer[:rows]


_workspace = Workspace()


@dataclass(frozen=True)
class Routed:
    """One layer call's S = T·k assignments sorted by expert: expert e's run is order[first[e]:][:counts[e]]."""

    order: torch.Tensor  # (S,) assignment ids; assignment t·k + j is token t's j-th choice
    token: torch.Tensor  # (S,) each one's token
    expert: torch.Tensor  # (S,) each one's expert
    first: list[int]  # (E,) where each expert's run starts
    counts: list[int]  # (E,) its length

    @classmethod
    def from_order(cls, top_k_index: torch.Tensor, order: torch.Tensor, counts: torch.Tensor) -> Routed:
        """`order` sorts the assignments by expert; counts (E,) are the experts' loads."""
        sizes = counts.tolist()
        return cls(order=order, token=order // top_k_index.shape[1], expert=top_k_index.reshape(-1)[order],
                   first=[0, *accumulate(sizes[:-1])], counts=sizes)


class MoeLayer:
    """The engine's replacement for one experts module's forward: (T, H) tokens in, (T, H) out.

    `submit` starts the group graphs (the backend's, on its device where it has one) and returns a future
    of their outputs; the CPU work runs meanwhile. `experts`: these weights already packed for the CPU,
    where the caller holds them. `post_norm`: the experts module's post-expert norm, where its layout has one.
    """

    def __init__(self, weights: ExpertWeights, layout: ExpertsLayout = DEFAULT_LAYOUT, *,
                 groups: list[StaticGroup] | None = None, overflow: str = SPILL, submit: Submit = run_now,
                 experts: CpuExperts | None = None, post_norm: PostNorm | None = None) -> None:
        if overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"overflow must be one of {', '.join(OVERFLOW_POLICIES)}, got {overflow!r}")
        if layout.post_norm and post_norm is None:
            raise ValueError("the experts layout has a post-expert norm: pass the module's post_norm")
        self.experts = experts if experts is not None else CpuExperts(weights, layout)
        self.post_norm = post_norm
        self.groups = groups or []
        self.overflow = overflow
        self.submit = submit
        self.loads: list[torch.Tensor] | None = None  # when a list, each call appends its (E,) token counts
        self._tables(weights.gate_up.device)

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    def _tables(self, device: torch.device) -> None:
        """Per-expert lookup tables for packing: every group's buffer lies back to back in one (rows, H)."""
        E = self.num_experts
        self.resident = torch.zeros(E, dtype=torch.bool, device=device)
        self.capacity = torch.zeros(E, dtype=torch.long, device=device)
        self.group_of = torch.full((E,), -1, dtype=torch.long, device=device)
        self.group_rows: list[slice] = []
        self.group_row: dict[int, tuple[int, int]] = {}  # expert -> (its group, its first row in the group's output)
        row = 0
        for g, group in enumerate(self.groups):
            ids = torch.tensor(group.experts, dtype=torch.long, device=device)
            if self.resident[ids].any() or ids.unique().numel() != ids.numel():
                raise ValueError(f"group {g}: an expert of {group.experts} is already in a group")
            self.resident[ids] = True
            self.capacity[ids] = group.capacity
            self.group_of[ids] = g
            self.group_row.update({e: (g, j * group.capacity) for j, e in enumerate(group.experts)})
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
            y = self.exact(x, top_k_index, top_k_weights, counts)
        if stats is not None:
            self._count(stats, counts)
        return y

    def exact(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
              counts: torch.Tensor | None = None) -> torch.Tensor:
        """Every assignment on the exact CPU path (decode steps, and layers without a plan)."""
        if top_k_index.shape[0] == 1:
            return self._one_token(x, top_k_index, top_k_weights)
        expert = top_k_index.reshape(-1)  # (S,)
        if counts is None:
            counts = torch.bincount(expert, minlength=self.num_experts)
        routed = Routed.from_order(top_k_index, torch.argsort(expert, stable=True), counts)
        out = _workspace.get("out", expert.numel(), x)  # (S, H) each assignment's expert output, sorted
        run_tasks(self._cpu_tasks(out, x, routed, skip=[0] * self.num_experts))
        self._normalise(out)
        return combine(out, routed.order, top_k_weights)

    def _one_token(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """A decode step's token: its k experts in the order it chose them, with nothing to sort or share out among
        workers (the sort, the task list and the gather are Python and small-tensor overhead one token does not
        need). The combine sums the same rows in the same order as the sorted path: the result is the same."""
        k, x = top_k_index.shape[1], x.contiguous()
        out = _workspace.get("out", k, x)  # (k, H): row j is the token's j-th choice
        for j, e in enumerate(top_k_index[0].tolist()):
            self.experts(e, x, out=out[j:j + 1])
        self._normalise(out)
        return combine(out, torch.arange(k, device=x.device), top_k_weights)

    def _planned(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 counts: torch.Tensor) -> torch.Tensor:
        expert = top_k_index.reshape(-1)  # (S,)
        # Sort by expert; under prune, the most important first within each expert.
        if self.overflow == PRUNE:
            importance = top_k_weights.reshape(-1) * x.float().norm(dim=-1).repeat_interleave(top_k_index.shape[1])
            by_importance = torch.argsort(importance, descending=True, stable=True)
            order = by_importance[torch.argsort(expert[by_importance], stable=True)]
        else:
            order = torch.argsort(expert, stable=True)
        routed = Routed.from_order(top_k_index, order, counts)

        # Each resident expert's first static_counts[e] assignments go into its buffer slice.
        static_counts = self.static_per_expert(counts)  # (E,)
        packed = self.pack(x, routed, static_counts)
        launched = [g for g, work in enumerate(self._group_work(counts).tolist()) if work]
        pending = self.submit([(self.groups[g].graph, self.buffer(packed, g)) for g in launched])

        # Meanwhile the CPU runs the rest of every run: cold experts whole, resident ones' overflow under
        # spill; under prune that overflow is dropped, and its rows of `out` (sorted) stay zero.
        out = _workspace.get("out", order.numel(), x)
        if self.overflow == PRUNE:
            out.zero_()
        skip = counts * self.resident if self.overflow == PRUNE else static_counts
        run_tasks(self._cpu_tasks(out, x, routed, skip=skip.tolist()))

        self.unpack(out, dict(zip(launched, pending.result(), strict=True)), routed, static_counts)
        pruned = self.overflow == PRUNE and self.post_norm is not None
        self._normalise(out, dropped=self._over_capacity(routed, static_counts) if pruned else None)
        return combine(out, order, top_k_weights)

    def pack(self, x: torch.Tensor, routed: Routed, static_counts: torch.Tensor) -> torch.Tensor:
        """Every group's (G, C, H) buffer, back to back in one (rows, H): each resident expert's first
        static_counts[e] assignments' token rows gathered straight into its slice (they are the first
        static_counts[e] of its run in sorted order), one task per expert shared out over the workers. Padding rows
        are never written: a graph computes each row alone and their outputs are never read, so they keep zeros
        or an earlier call's rows."""
        packed = _workspace.get("packed", self.rows, x, finite=True)
        token = routed.token

        def task(e: int, n: int) -> Task:
            (g, row), lo = self.group_row[e], routed.first[e]
            base = self.group_rows[g].start + row
            return lambda: torch.index_select(x, 0, token[lo:lo + n], out=packed[base:base + n])

        run_tasks(_by_size(task, static_counts))
        return packed

    def unpack(self, out: torch.Tensor, outputs: dict[int, torch.Tensor], routed: Routed,
                static_counts: torch.Tensor) -> None:
        """Each static assignment's output from its group graph's (G, C, H) output into its row of `out` (sorted).
        An expert's static assignments are one slice of its run in `out` and one slice of its graph's output, so
        each is one contiguous copy (no gather through an index, no boolean mask): one task per expert, shared out
        over the workers."""
        H = out.shape[1]
        flat = {g: y.reshape(-1, H) for g, y in outputs.items()}

        def task(e: int, n: int) -> Task:
            (g, row), lo = self.group_row[e], routed.first[e]
            return lambda: out[lo:lo + n].copy_(flat[g][row:row + n])

        run_tasks(_by_size(task, static_counts))

    def _over_capacity(self, routed: Routed, static_counts: torch.Tensor) -> torch.Tensor:
        """(S,) whether each assignment (sorted) is a resident expert's beyond its capacity."""
        return self.resident[routed.expert] & (_rank(routed) >= static_counts[routed.expert])

    def _normalise(self, out: torch.Tensor, dropped: torch.Tensor | None = None) -> None:
        """Apply the post-expert norm, if any, to every expert output in `out`; rows of dropped assignments
        stay zero (a norm with a bias would move them)."""
        if self.post_norm is None:
            return
        out.copy_(self.post_norm(out))
        if dropped is not None:
            out[dropped] = 0

    def buffer(self, packed: torch.Tensor, g: int) -> torch.Tensor:
        """Group g's (G, C, H) view of the packed buffers."""
        group = self.groups[g]
        return packed[self.group_rows[g]].view(len(group.experts), group.capacity, packed.shape[1])

    def _cpu_tasks(self, out: torch.Tensor, x: torch.Tensor, routed: Routed, skip: Sequence[int]) -> list[Task]:
        """Tasks for the CPU work, the longest first. Expert e's work is the assignments of its run after the
        first skip[e]: out[i] = FFN_e(x[token[i]]) for each of their places i in sorted order. It is one task,
        or several when it is more than a worker's share, so that one hot expert cannot idle the others (each
        piece reads the expert's weights again, which that many rows amortise)."""
        token = routed.token  # (S,)

        def task(e: int, lo: int, hi: int) -> Task:
            return lambda: self.experts(e, x.index_select(0, token[lo:hi]), out=out[lo:hi])

        spans = [(routed.first[e] + s, routed.first[e] + n, e)
                 for e, (n, s) in enumerate(zip(routed.counts, skip, strict=True)) if n > s]
        share = max(1, -(-sum(hi - lo for lo, hi, _ in spans) // torch.get_num_threads()))
        pieces = [(start, min(start + share, hi), e) for lo, hi, e in spans for start in range(lo, hi, share)]
        pieces.sort(key=lambda piece: piece[0] - piece[1])
        return [task(e, lo, hi) for lo, hi, e in pieces]

    def static_per_expert(self, counts: torch.Tensor) -> torch.Tensor:
        """(E,) assignments each expert runs in its group graph."""
        return torch.minimum(counts, self.capacity) * self.resident

    def _group_work(self, counts: torch.Tensor) -> torch.Tensor:
        """(n_groups,) static assignments per group; a group with none is not launched."""
        work = torch.zeros(len(self.groups), dtype=torch.long, device=counts.device)
        return work.index_add_(0, self.group_of[self.resident], self.static_per_expert(counts)[self.resident])

    def _count(self, stats: DispatchStats, counts: torch.Tensor) -> None:
        static = self.static_per_expert(counts)  # (E,)
        over = int(((counts - static) * self.resident).sum())
        launched = self._group_work(counts) > 0  # (n_groups,)
        slots = int(self.group_slots[launched].sum())
        stats.layer_calls += 1
        stats.assignments += int(counts.sum())
        stats.static += int(static.sum())
        stats.cpu += int((counts * ~self.resident).sum())
        stats.spilled += over if self.overflow == SPILL else 0
        stats.dropped += over if self.overflow == PRUNE else 0
        stats.slots += slots
        stats.padding_slots += slots - int(static.sum())
        stats.launches += int(launched.sum())
        stats.expert_launches += int((static > 0).sum())


def _by_size(task: Callable[[int, int], Task], counts: torch.Tensor) -> list[Task]:
    """task(e, counts[e]) for every expert with a nonzero count, the largest first (as run_tasks wants them)."""
    sizes = counts.tolist()
    return [task(e, sizes[e]) for e in sorted((e for e, n in enumerate(sizes) if n), key=lambda e: -sizes[e])]


def _rank(routed: Routed) -> torch.Tensor:
    """(S,) each sorted assignment's place in its expert's run."""
    first = torch.tensor(routed.first, device=routed.order.device)
    return torch.arange(routed.order.numel(), device=routed.order.device) - first[routed.expert]


def combine(out: torch.Tensor, order: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """(S, H) expert outputs in sorted order (out[i] belongs to assignment order[i]) and (T, k) router weights
    -> (T, H): each token's weighted sum, accumulated in float32 so a bf16 sum is rounded once, by the engine's
    combine kernel where it runs (combine_kernel.py), else as a (1, k) x (k, H) matmul per token. Weights finer
    than the outputs (a float32 router beside bf16 experts) are not rounded to them: the sum is taken in their
    dtype, as transformers does."""
    T, k = top_k_weights.shape
    at = torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=order.device))  # order⁻¹
    if combine_kernel.supports(out, top_k_weights):
        return combine_kernel.combine(out, at, top_k_weights)
    # (S, H) token-major: row t·k + j is token t's j-th assignment's output
    by_token = torch.index_select(out, 0, at, out=_workspace.get("by_token", len(order), out))
    dtype = torch.promote_types(out.dtype, top_k_weights.dtype)
    weighted = torch.bmm(top_k_weights.to(dtype).reshape(T, 1, k), by_token.view(T, k, -1).to(dtype))
    return weighted.view(T, -1).to(out.dtype)
