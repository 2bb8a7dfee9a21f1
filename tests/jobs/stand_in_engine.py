"""A stand-in for the engine that reports a few chunks and returns a fixed result, so that the tests of jobs/
specify the jobs layer's own behaviour; the real engine runs in tests/daemon/test_e2e.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from npumoe.engine import DocumentResult, EngineSettings, Progress, RunStats
from npumoe.engine.moe.dispatch import DispatchStats


@dataclass
class StandInEngine:
    chunks: int = 3
    error: Exception | None = None
    model_key: str = "stand-in@0"
    residency: None = None  # no plan: every expert on the exact CPU path
    settings: EngineSettings = field(default_factory=lambda: EngineSettings(model="stand-in", weights="bf16"))
    texts: list[str] = field(default_factory=list)

    def process(self, text: str, on_progress: Callable[[Progress], None] | None = None,
                check: Callable[[], None] | None = None) -> DocumentResult:
        self.texts.append(text)
        for done in range(1, self.chunks + 1):
            assert on_progress is not None and check is not None
            check()  # as the engine runs it, within every chunk
            on_progress(Progress("prefill", done, self.chunks, 10 * done, 10 * self.chunks, 0.5 * done))
        if self.error is not None:
            raise self.error
        stats = RunStats(tokens=10 * self.chunks, chunks=self.chunks, chunk_tokens=10, sections=1, reduce_rounds=0,
                         generated_tokens=3,
                         seconds={"prefill": 0.1, "summary": 0.2, "reduce": 0.0, "total": 0.3},
                         dispatch=DispatchStats())
        rows = np.arange((self.chunks + 1) * 4, dtype=np.float32).reshape(self.chunks + 1, 4)
        cuts = np.linspace(0, len(text), self.chunks + 1).astype(np.int64)
        spans = np.stack([cuts[:-1], cuts[1:]], axis=1)  # the text in equal parts, one per chunk
        return DocumentResult(summary="The stand-in summary.", embeddings=rows, spans=spans, stats=stats)


@dataclass
class StandInModel:
    engine: StandInEngine = field(default_factory=StandInEngine)
    settings: EngineSettings = field(default_factory=lambda: EngineSettings(model="stand-in", summary_tokens=8))

    def load(self) -> StandInEngine:
        return self.engine
