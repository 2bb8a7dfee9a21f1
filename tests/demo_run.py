"""The demo model (SmolLM2-135M-Instruct upcycled; `make setup` builds it) on the six samples, processed once per
session (conftest's `demo_run`): the summary, retrieval and equals-dense tests share it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from npumoe.engine import DocumentResult, Engine


SUMMARY_TOKENS = 64


@dataclass(frozen=True)
class DemoRun:
    """The demo model's engine and its results on the six samples, by file name."""

    engine: Engine
    texts: dict[str, str]
    results: dict[str, DocumentResult]


def process_samples() -> DemoRun:
    """Each sample's text as the daemon extracts it, processed by the demo model: in the float format `auto` measures
    fastest here (bf16 where the CPU has it natively, fp32 where bf16 is emulated); the demo's section length; a
    fixed chunk length (none measured). One thread: on a 2-core machine other work shares, a second thread mostly
    waits for the first (a 10x slower decode step).
    Summaries of SUMMARY_TOKENS, well under the product's, since decoding is most of the cost."""
    from npumoe.bench.service.retrieval import sample_texts
    from npumoe.daemon.model_choice import DEMO_SECTION_TOKENS, demo_model
    from npumoe.engine import Engine, EngineSettings
    from npumoe.engine.vocabulary import AUTO, CHUNK_TOKENS

    engine = Engine.load(EngineSettings(model=str(demo_model()), weights=AUTO, chunk_tokens=CHUNK_TOKENS,
                                        section_tokens=DEMO_SECTION_TOKENS, summary_tokens=SUMMARY_TOKENS,
                                        threads=1))
    texts = sample_texts()
    return DemoRun(engine, texts, {name: engine.process(text) for name, text in texts.items()})
