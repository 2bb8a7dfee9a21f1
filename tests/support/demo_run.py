"""The demo model (SmolLM2-135M-Instruct upcycled; `make setup` builds it) on the six samples, processed once per
session (conftest's `demo_run`): the summary, retrieval and equals-dense tests share it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from npumoe.jobs.search.index import Weights

if TYPE_CHECKING:
    import numpy as np

    from npumoe.engine import DocumentResult, Engine


SUMMARY_TOKENS = 64

# Measured on the demo model (README, Search; mean pooling, the default weights): passage 0.333, document 1.000.
PASSAGE_RECALL_BAR = 0.3
DOCUMENT_RECALL_BAR = 0.95
# The bars above hold the engine's own vectors on the samples, scored as when they were measured (docs/benchmarks.md,
# the six samples' section). The index now uses the search model's vectors, scored with search.index.WEIGHTS.
ENGINE_WEIGHTS = Weights(cosine=0.5, words=0.25, phrase=0.25)


# The long sample: ten sections of summaries and their combine, most of the run's decoding. The default suite
# embeds it (retrieval needs its vectors); its summary is checked by a slow test, which processes it whole.
LONG = "night-shift-log.txt"
# Under emulation (make test-arm64) the run takes over ten times as long (the six samples' over 30 minutes): there it
# processes only this many samples, the shortest first, so the retrieval test, which needs every sample's vectors,
# is skipped.
PROCESSED_VARIABLE = "NPUMOE_TEST_DEMO_SAMPLES"


@dataclass(frozen=True)
class DemoRun:
    """The demo model's engine; its results on the samples but the long one (as many as PROCESSED_VARIABLE
    allows), by file name; the vectors (embeddings, spans) of every sample (of those), as `process` makes them."""

    engine: Engine
    gguf: Path  # the dense model the demo model was made from
    texts: dict[str, str]
    results: dict[str, DocumentResult]
    vectors: dict[str, tuple[np.ndarray, np.ndarray]]


def process_samples(models: Path) -> DemoRun:
    """Each sample's text as the daemon extracts it, processed by the demo model: in the demo's weights (fp32) and
    section length; a fixed chunk length (none measured). One thread: on a 2-core machine other work shares, a
    second thread mostly waits for the first (a 10x slower decode step).
    Summaries of SUMMARY_TOKENS, well under the product's, since decoding is most of the cost."""
    from npumoe.bench.service.retrieval import sample_texts
    from npumoe.daemon.model_choice import DEMO_SECTION_TOKENS, DEMO_WEIGHTS, demo_model
    from npumoe.engine import Engine, EngineSettings
    from npumoe.engine.synthetic.smollm2 import GGUF
    from npumoe.engine.vocabulary import CHUNK_TOKENS

    with pytest.MonkeyPatch.context() as env:  # every other test sees an empty models cache (conftest)
        env.setenv("NPUMOE_MODELS", str(models))
        model = demo_model()
    engine = Engine.load(EngineSettings(model=str(model), weights=DEMO_WEIGHTS, chunk_tokens=CHUNK_TOKENS,
                                        section_tokens=DEMO_SECTION_TOKENS, summary_tokens=SUMMARY_TOKENS,
                                        threads=1))
    texts = sample_texts()
    processed = os.environ.get(PROCESSED_VARIABLE)
    if processed:
        texts = dict(sorted(texts.items(), key=lambda item: len(item[1]))[:int(processed)])
    results = {name: engine.process(text) for name, text in texts.items() if name != LONG}
    vectors = {name: (result.embeddings, result.spans) for name, result in results.items()}
    if LONG in texts:
        vectors[LONG] = engine.embed_document(texts[LONG])
    return DemoRun(engine, models / GGUF, texts, results, vectors)


class Processed:
    """The demo engine, whose documents' vectors are those the shared demo run already made."""

    def __init__(self, run: DemoRun) -> None:
        self.run, self.model_key = run, run.engine.model_key

    def embed(self, text: str, pooling: str | None = None) -> np.ndarray:
        return self.run.engine.embed(text, pooling)

    def embed_document(self, text: str, pooling: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        assert pooling == self.run.engine.settings.pooling  # the pooling the run made its vectors with
        (name,) = [name for name, t in self.run.texts.items() if t == text]
        return self.run.vectors[name]
