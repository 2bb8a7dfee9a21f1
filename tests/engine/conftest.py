"""Fixtures of the engine's tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from npumoe.engine import Engine, EngineSettings, LoadedModel, load_model
from npumoe.engine.generate.summary import SUMMARIZE, PromptFrame
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


@pytest.fixture(scope="module")
def engine(tiny: Callable[..., Path]) -> Engine:
    """The engine on the tiny Qwen3-MoE: fp32, as the reference is (weights auto may choose bf16 here), 128-token
    chunks, 16-token summaries."""
    return Engine.load(EngineSettings(model=str(tiny("qwen3_moe")), chunk_tokens=128, summary_tokens=16,
                                      weights="fp32"))


@pytest.fixture(scope="module")
def reference(tiny: Callable[..., Path]) -> LoadedModel:
    """The same checkpoint loaded as transformers runs it, no engine attached: what the engine is checked against."""
    return load_model(str(tiny("qwen3_moe")))


@pytest.fixture(scope="module")
def summary_prefix(reference: LoadedModel) -> list[int]:
    """The summary prompt's tokens before the document; they share the first prefill chunk."""
    return PromptFrame.build(reference.tokenizer, SUMMARIZE).prefix
