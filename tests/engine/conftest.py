"""Fixtures of the engine's tests."""

from __future__ import annotations

import pytest

from npumoe.engine.cpu_experts import CpuExperts


@pytest.fixture
def packed_at_load(monkeypatch: pytest.MonkeyPatch) -> list[CpuExperts]:
    """The CPU experts a streaming load packs as it reads (CpuExperts.streamed), in the order it makes them."""
    made: list[CpuExperts] = []
    streamed = CpuExperts.streamed.__func__
    monkeypatch.setattr(CpuExperts, "streamed",
                        classmethod(lambda cls, *a, **k: made.append(streamed(cls, *a, **k)) or made[-1]))
    return made
