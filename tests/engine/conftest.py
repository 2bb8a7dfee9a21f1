"""Fixtures of the engine's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from npumoe.engine.moe.cpu_experts import CpuExperts


@pytest.fixture
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """torch threads for one test (the suite runs with one); parametrize indirectly to choose how many."""
    count = getattr(request, "param", 2)
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    yield count
    torch.set_num_threads(before)


@pytest.fixture
def packed_at_load(monkeypatch: pytest.MonkeyPatch) -> list[CpuExperts]:
    """The CPU experts a streaming load packs as it reads (CpuExperts.streamed), in the order it makes them."""
    made: list[CpuExperts] = []
    streamed = CpuExperts.streamed.__func__
    monkeypatch.setattr(CpuExperts, "streamed",
                        classmethod(lambda cls, *a, **k: made.append(streamed(cls, *a, **k)) or made[-1]))
    return made
