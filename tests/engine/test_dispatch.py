"""Dispatch on a hand-built routing case: exact counts of static, cold, spilled, dropped and padding."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from npumoe.engine.backends.registry import get_backend
from npumoe.engine.moe.cpu_experts import CpuExperts
from npumoe.engine.moe.dispatch import DispatchStats, GraphCalls, MoeLayer, StaticGroup, run_now
from npumoe.engine.moe.experts_layout import DEFAULT_LAYOUT, ExpertWeights

E, H, FFN = 4, 8, 4

# Six tokens, top-2. Expert loads: e0 5, e1 2, e2 3, e3 2 (e3 is cold: in no group).
ROUTING = [(0, 1), (0, 2), (0, 3), (0, 2), (0, 1), (2, 3)]
WEIGHTS = [(0.9, 0.1), (0.5, 0.5), (0.5, 0.5), (0.5, 0.5), (0.01, 0.99), (0.5, 0.5)]
# Groups: e0+e1 at capacity 4 (e0 overflows by 1), e2 alone at capacity 2 (overflows by 1).
GROUPS = [((0, 1), 4), ((2,), 2)]


@pytest.fixture
def weights() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(E, 2 * FFN, H, generator=g), torch.randn(E, H, FFN, generator=g)


@pytest.fixture
def tokens() -> torch.Tensor:
    """Token t has norm t + 1, so importance (weight × norm) is known."""
    x = F.normalize(torch.randn(len(ROUTING), H, generator=torch.Generator().manual_seed(1)), dim=-1)
    return x * torch.arange(1, len(ROUTING) + 1, dtype=torch.float32)[:, None]


@pytest.fixture
def two_threads() -> Iterator[None]:
    """Two torch threads (the suite runs with one), so the CPU experts are shared out to workers."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def layer(weights: tuple[torch.Tensor, torch.Tensor], overflow: str, groups=GROUPS, submit=run_now) -> MoeLayer:
    experts_weights = ExpertWeights(*weights)
    backend = get_backend("torch-static")
    return MoeLayer(experts_weights, overflow=overflow, submit=submit, groups=[
        StaticGroup(experts, capacity, backend.build_group(experts_weights.select(experts), DEFAULT_LAYOUT, capacity))
        for experts, capacity in groups])


def reference(x: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor], routing, routing_weights) -> torch.Tensor:
    """Every token through its experts one by one: y_t = sum_j w_tj * FFN_e(x_t)."""
    gate_up, down = weights
    y = torch.zeros_like(x)
    for t, (experts, ws) in enumerate(zip(routing, routing_weights, strict=True)):
        for e, w in zip(experts, ws, strict=True):
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            y[t] += w * (down[e] @ (F.silu(gate) * up))
    return y


def route(routing=ROUTING, routing_weights=WEIGHTS) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(routing), torch.tensor(routing_weights)


def test_spill_runs_overflow_on_the_cpu_and_matches_the_reference_exactly(weights, tokens):
    stats = DispatchStats()
    y = layer(weights, "spill")(tokens, *route(), stats)
    torch.testing.assert_close(y, reference(tokens, weights, ROUTING, WEIGHTS), rtol=1e-5, atol=1e-5)
    assert (stats.assignments, stats.static, stats.cpu, stats.spilled, stats.dropped) == (12, 8, 2, 2, 0)


def test_slots_padding_and_launches_are_counted_per_launched_group(weights, tokens):
    stats = DispatchStats()
    layer(weights, "spill")(tokens, *route(), stats)
    # Group e0+e1: 2 x 4 slots holding 4 + 2; group e2: 1 x 2 slots holding 2.
    assert (stats.slots, stats.padding_slots) == (10, 2)
    assert (stats.launches, stats.expert_launches, stats.layer_calls) == (2, 3, 1)
    assert stats.to_dict()["padding_fraction"] == pytest.approx(0.2)


def test_prune_drops_the_least_important_assignments_by_weight_times_norm(weights, tokens):
    stats = DispatchStats()
    y = layer(weights, "prune")(tokens, *route(), stats)
    # e0's least important is token 4 (0.01 x 5), not token 0 (smallest norm, but weight 0.9);
    # e2's is token 1 (0.5 x 2).
    kept = [list(w) for w in WEIGHTS]
    kept[4][0] = 0.0
    kept[1][1] = 0.0
    torch.testing.assert_close(y, reference(tokens, weights, ROUTING, kept), rtol=1e-5, atol=1e-5)
    assert (stats.static, stats.cpu, stats.spilled, stats.dropped) == (8, 2, 0, 2)
    assert stats.to_dict()["dropped_fraction"] == pytest.approx(2 / 12)


def test_a_group_without_tokens_is_not_launched(weights, tokens):
    stats = DispatchStats()
    routing = [(0, 3)] * 3
    layer(weights, "spill")(tokens[:3], *route(routing, [(0.5, 0.5)] * 3), stats)
    assert (stats.launches, stats.slots, stats.padding_slots, stats.static, stats.cpu) == (1, 8, 5, 3, 3)


def test_without_groups_every_assignment_runs_exactly_on_the_cpu(weights, tokens):
    stats = DispatchStats()
    y = MoeLayer(ExpertWeights(*weights))(tokens, *route(), stats)
    torch.testing.assert_close(y, reference(tokens, weights, ROUTING, WEIGHTS), rtol=1e-5, atol=1e-5)
    assert (stats.cpu, stats.static, stats.slots, stats.launches) == (12, 0, 0, 0)


def test_the_exact_path_ignores_groups_and_counts_nothing(weights, tokens):
    y = layer(weights, "prune").exact(tokens, *route())
    torch.testing.assert_close(y, reference(tokens, weights, ROUTING, WEIGHTS), rtol=1e-5, atol=1e-5)


def test_an_expert_in_two_groups_is_refused(weights):
    with pytest.raises(ValueError, match="already in a group"):
        layer(weights, "spill", groups=[((0, 1), 4), ((1, 2), 4)])


def test_an_unknown_overflow_policy_is_refused(weights):
    with pytest.raises(ValueError, match="overflow must be one of spill, prune"):
        MoeLayer(ExpertWeights(*weights), overflow="drop")


class RecordedExperts:
    """A layer's CPU experts, noting each call."""

    def __init__(self, experts: CpuExperts, events: list[str]) -> None:
        self.experts, self.events = experts, events
        self.rows: list[tuple[int, int]] = []  # (expert, rows) per call

    def __len__(self) -> int:
        return len(self.experts)

    def __call__(self, e: int, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        self.events.append(f"cpu expert {e}")
        self.rows.append((e, x.shape[0]))
        return self.experts(e, x, out)


def test_group_graphs_are_submitted_before_the_cpu_experts_run(weights, tokens, two_threads):
    events: list[str] = []

    def submit(calls: GraphCalls):
        events.append(f"submit {len(calls)} graphs")
        return run_now(calls)

    moe = layer(weights, "spill", submit=submit)
    moe.experts = RecordedExperts(moe.experts, events)
    y = moe(tokens, *route())
    torch.testing.assert_close(y, reference(tokens, weights, ROUTING, WEIGHTS), rtol=1e-5, atol=1e-5)
    # e3 is cold; e0 and e2 spill one assignment each.
    assert events[0] == "submit 2 graphs" and sorted(events[1:]) == ["cpu expert 0", "cpu expert 2", "cpu expert 3"]


def test_the_exact_path_gives_the_same_result_on_one_thread_as_on_two_workers(two_threads):
    """Skewed routing over many experts in bf16: each expert's rows go through the same single-threaded
    kernels however the experts are shared out."""
    g = torch.Generator().manual_seed(2)
    experts, hidden, ffn, tokens, k = 16, 64, 32, 200, 4
    gate_up = (torch.randn(experts, 2 * ffn, hidden, generator=g) / hidden**0.5).to(torch.bfloat16)
    down = (torch.randn(experts, hidden, ffn, generator=g) / ffn**0.5).to(torch.bfloat16)
    popularity = 1 / torch.arange(1, experts + 1, dtype=torch.float)  # Zipf: expert 0 the busiest
    index = torch.multinomial(popularity.expand(tokens, -1), k, generator=g)
    weights = torch.softmax(torch.randn(tokens, k, generator=g), -1).to(torch.bfloat16)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    moe = MoeLayer(ExpertWeights(gate_up, down))
    on_workers = moe.exact(x, index, weights)
    torch.set_num_threads(1)
    assert torch.equal(moe.exact(x, index, weights), on_workers)
    want = reference(x.float(), (gate_up.float(), down.float()), index.tolist(), weights.float().tolist())
    assert float((on_workers.float() - want).norm() / want.norm()) < 1e-2


def test_a_backend_without_a_device_runs_submitted_graphs_at_once_in_order() -> None:
    buffers = [torch.ones(2, 4, 8), torch.full((1, 8, 8), 3.0)]
    pending = get_backend("torch-static").submit([(lambda x: 2 * x, buffers[0]), (lambda x: x + 1, buffers[1])])
    assert pending.done()
    assert [r.tolist() for r in pending.result()] == [(2 * buffers[0]).tolist(), (buffers[1] + 1).tolist()]


def test_calls_of_any_size_in_and_out_of_inference_mode_each_give_the_reference(weights, tokens, two_threads):
    """Layer calls share buffers: a shorter call after a longer one, and one without inference mode after
    one inside it, must see none of the earlier call."""
    moe = layer(weights, "spill")
    for count, mode in ((6, torch.inference_mode), (3, torch.no_grad), (6, torch.no_grad), (2, torch.inference_mode)):
        routing = route(ROUTING[:count], WEIGHTS[:count])
        with mode():
            exact, planned = moe.exact(tokens[:count], *routing), moe(tokens[:count], *routing)
        want = reference(tokens[:count], weights, ROUTING[:count], WEIGHTS[:count])
        torch.testing.assert_close(exact, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(planned, want, rtol=1e-5, atol=1e-5)


def test_an_expert_with_more_than_a_workers_share_of_the_rows_is_split_between_workers(weights, two_threads):
    tokens = torch.randn(40, H, generator=torch.Generator().manual_seed(3))
    routing = [(0, 1 + t % 3) for t in range(40)]  # e0 holds half of the 80 assignments
    moe = MoeLayer(ExpertWeights(*weights))
    moe.experts = recorded = RecordedExperts(moe.experts, [])
    y = moe(tokens, *route(routing, [(0.7, 0.3)] * 40))
    torch.testing.assert_close(y, reference(tokens, weights, routing, [(0.7, 0.3)] * 40), rtol=1e-5, atol=1e-5)
    assert sorted(n for e, n in recorded.rows if e == 0) == [40]  # two workers: a share is 40 rows
    torch.set_num_threads(3)  # a share is 27 rows
    recorded.rows.clear()
    moe(tokens, *route(routing, [(0.7, 0.3)] * 40))
    assert sorted(n for e, n in recorded.rows if e == 0) == [13, 27]


def test_one_token_skips_the_sort_and_gives_what_the_sorted_path_gives(monkeypatch):
    """A decode step's token runs its experts in the order it chose them; each expert sees one row either way, so
    the output is the same to the bit as the sorted path's for a token routed alongside another."""
    g = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(E, 2 * FFN, H, generator=g) / H**0.5).to(torch.bfloat16)
    down = (torch.randn(E, H, FFN, generator=g) / FFN**0.5).to(torch.bfloat16)
    moe = MoeLayer(ExpertWeights(gate_up, down))
    x = torch.randn(2, H, generator=g).to(torch.bfloat16)
    index = torch.tensor([[3, 0], [1, 2]])  # not sorted, and no expert shared: one row per expert in both paths
    weights = torch.softmax(torch.randn(2, 2, generator=g), -1)
    one_token = MoeLayer._one_token
    calls = []
    monkeypatch.setattr(MoeLayer, "_one_token", lambda self, *a: calls.append(1) or one_token(self, *a))
    sorted_path = moe.exact(x, index, weights)
    assert calls == []
    alone = moe.exact(x[:1], index[:1], weights[:1])
    assert calls == [1]
    assert torch.equal(alone, sorted_path[:1])
    want = reference(x.float(), (gate_up.float(), down.float()), index.tolist(), weights.tolist())
    torch.testing.assert_close(alone.float(), want[:1], rtol=2e-2, atol=2e-2)


def test_padding_rows_outputs_are_never_read(weights, tokens):
    """A graph computes each buffer row alone, so the padding rows need no zeroing: a graph that writes NaN into
    every row it was not given a token for changes nothing."""
    experts_weights = ExpertWeights(*weights)
    filled: list[int] = []

    def nan_in_padding(graph):
        def run(x: torch.Tensor) -> torch.Tensor:
            y = graph(x).clone()
            # packing never writes padding rows; mark every row but the first `n` of each expert
            for g, n in enumerate(filled_rows(x)):
                y[g, n:] = float("nan")
            filled.append(1)
            return y
        return run

    def filled_rows(x: torch.Tensor) -> list[int]:  # e0: 4 of 4, e1: 2 of 4 (ROUTING), e2: 2 of 2
        return {(2, 4): [4, 2], (1, 2): [2]}[tuple(x.shape[:2])]

    backend = get_backend("torch-static")
    moe = MoeLayer(experts_weights, overflow="spill", groups=[
        StaticGroup(experts, capacity, nan_in_padding(backend.build_group(experts_weights.select(experts),
                                                                           DEFAULT_LAYOUT, capacity)))
        for experts, capacity in GROUPS])
    y = moe(tokens, *route())
    assert len(filled) == 2  # both graphs ran
    torch.testing.assert_close(y, reference(tokens, weights, ROUTING, WEIGHTS), rtol=1e-5, atol=1e-5)


def test_packing_and_unpacking_share_the_experts_out_over_the_workers_and_leave_padding_rows_alone(
        weights, tokens, two_threads, monkeypatch):
    """Each resident expert's static rows are one task in packing and one in unpacking (so two cores share the
    host's copies); its padding rows keep what the buffer held, and the result is the reference's."""
    from npumoe.engine.moe import dispatch

    tasks: list[int] = []

    def counting(run):
        def run_counted(batch):
            tasks.append(len(batch))
            return run(batch)
        return run_counted

    moe = layer(weights, "spill")
    index, routing_weights = route()
    counts = torch.bincount(index.reshape(-1), minlength=E)
    routed = dispatch.Routed.from_order(index, torch.argsort(index.reshape(-1), stable=True), counts)
    static = moe.static_per_expert(counts)  # e0 4, e1 2, e2 2
    packed = moe.pack(tokens, routed, static)
    packed.fill_(-7.0)  # what an earlier call left
    monkeypatch.setattr(dispatch, "run_tasks", counting(dispatch.run_tasks))
    packed = moe.pack(tokens, routed, static)
    assert tasks == [3]  # e0, e1 and e2 each one task; e3 is cold
    want = {0: [0, 1, 2, 3], 1: [0, 4], 2: [1, 3]}  # each expert's first tokens in sorted order
    for e, rows in want.items():
        g, row = moe.group_row[e]
        base = moe.group_rows[g].start + row
        assert torch.equal(packed[base:base + len(rows)], tokens[rows])
    assert torch.equal(packed[6:8], torch.full((2, H), -7.0))  # e1's padding rows, untouched
    out = torch.zeros(len(index.reshape(-1)), H)
    moe.unpack(out, {g: moe.buffer(packed, g) for g in range(len(GROUPS))}, routed, static)
    assert tasks == [3, 3]
    for e, rows in want.items():
        assert torch.equal(out[routed.first[e]:routed.first[e] + len(rows)], tokens[rows])
    tasks.clear()
    y = moe(tokens, index, routing_weights)
    torch.testing.assert_close(y, reference(tokens, weights, ROUTING, WEIGHTS), rtol=1e-5, atol=1e-5)
    assert tasks[0] == 3 and tasks[-1] == 3  # the layer call packed and unpacked through the workers
