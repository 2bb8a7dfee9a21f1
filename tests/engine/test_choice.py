"""The measured-choice mechanism's statistic: candidates timed in turns, and a laggard timed no more than it must."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from npumoe.engine.kernels import choice
from npumoe.engine.kernels.choice import Rounds, time_in_turns


def timed_runs(monkeypatch, cost: dict[str, float]) -> tuple[Callable[[str, int], None], Counter[str]]:
    """A run that takes `cost[candidate]` seconds of a clock the statistic reads, and the count of runs it made."""
    clock = [0.0]
    monkeypatch.setattr(choice.time, "perf_counter", lambda: clock[0])
    runs: Counter[str] = Counter()

    def run(candidate: str, item: int) -> None:
        runs[candidate] += 1
        clock[0] += cost[candidate]

    return run, runs


def test_a_candidate_many_times_slower_than_the_fastest_is_timed_once_and_keeps_its_figure(monkeypatch):
    cost = {"fast": 1.0, "close": 1.5, "laggard": 1.0 + choice.LAGGARD}  # the laggard just past the line
    run, runs = timed_runs(monkeypatch, cost)
    seconds = time_in_turns(list(cost), 1, run, rounds=Rounds(least=5, most=5, budget_s=0.0, warmup=1))
    assert seconds == cost  # every candidate has its figure
    assert runs == {"fast": 6, "close": 6, "laggard": 2}  # a warm-up and one timed round for the laggard


def test_a_candidate_far_slower_in_the_warm_up_is_not_timed_at_all_and_keeps_its_warm_up_figure(monkeypatch):
    cost = {"fast": 1.0, "slow": 4.0, "hopeless": 1.0 + choice.WARM_LAGGARD}  # the last just past the warm-up's line
    run, runs = timed_runs(monkeypatch, cost)
    seconds = time_in_turns(list(cost), 2, run, rounds=Rounds(least=4, most=4, budget_s=0.0, warmup=1))
    assert seconds == cost
    assert runs == {"fast": 6, "slow": 6, "hopeless": 1}  # a warm-up on the first of the two items, then nothing


def test_every_candidate_within_the_line_runs_every_round(monkeypatch):
    cost = {"a": 1.0, "b": choice.LAGGARD}
    run, runs = timed_runs(monkeypatch, cost)
    time_in_turns(list(cost), 1, run, rounds=Rounds(least=3, most=3, budget_s=0.0, warmup=0))
    assert runs == {"a": 3, "b": 3}
