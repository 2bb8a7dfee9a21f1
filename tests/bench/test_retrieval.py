"""`npumoed bench retrieval`: paraphrased questions about the samples, searched as `npumoed search` searches.

The measured test runs on the demo model (SmolLM2-135M-Instruct upcycled), with the documents' vectors of the
session's shared demo run (`Engine.process` makes them as `embed_document` does): its bars are at or below the
figures the README reports for that model. The command itself, which embeds everything again, runs in `make chaos`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from demo_run import DemoRun

from npumoe.bench.cli import bench
from npumoe.bench.service.questions import QUESTIONS
from npumoe.bench.service.retrieval import flat, measure
from npumoe.daemon.samples import sample_documents
from npumoe.engine.vocabulary import MEAN
from npumoe.jobs.search.index import WEIGHTS

# Measured on the demo model (README, Search; mean pooling, the default weights): passage 0.333, document 1.000.
PASSAGE_RECALL_BAR = 0.3
DOCUMENT_RECALL_BAR = 0.95


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


def words(text: str) -> list[str]:
    return re.findall(r"[\w'-]+", text.lower())


def test_each_question_asks_about_a_sentence_of_its_sample_in_other_words() -> None:
    texts = {d.filename: flat(" ".join(d.paragraphs)) for d in sample_documents()}
    assert {q.filename for q in QUESTIONS} == set(texts) and len(QUESTIONS) == 4 * len(texts)
    for q in QUESTIONS:
        assert flat(q.anchor) in texts[q.filename], q.anchor
        anchor = words(q.anchor)
        runs = {tuple(anchor[i:i + 3]) for i in range(len(anchor) - 2)}
        asked = words(q.question)
        copied = [run for run in zip(asked, asked[1:], asked[2:], strict=False) if run in runs]
        assert not copied, f"{q.question!r} copies {copied} from its anchor"


@pytest.mark.timeout(600)  # the first test to ask for the shared demo run waits for it
def test_the_demo_model_finds_the_answers_at_least_as_often_as_reported(demo_run) -> None:
    (default,) = [r for r in measure(Processed(demo_run), demo_run.texts, [MEAN]) if r.weights == WEIGHTS]
    assert default.questions == len(QUESTIONS)
    assert default.passage_recall_at_1 >= PASSAGE_RECALL_BAR > default.passage_chance
    assert default.document_recall_at_1 >= DOCUMENT_RECALL_BAR > default.document_chance


@pytest.mark.slow  # embeds the six samples again, and the questions, in every pooling
def test_bench_retrieval_prints_its_table_and_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "retrieval.json"
    result = CliRunner().invoke(bench, ["retrieval", "--pooling", MEAN, "--threads", "1", "--json", str(out)],
                                env={"NPUMOED_HOME": str(tmp_path / "home")}, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "passage R@1" in result.output and "chance:" in result.output
    written = json.loads(out.read_text())
    (default,) = [r for r in written["results"] if r["weights"] == {"cosine": WEIGHTS.cosine, "words": WEIGHTS.words,
                                                                     "phrase": WEIGHTS.phrase}]
    assert default["questions"] == len(QUESTIONS)
    assert default["passage_recall_at_1"] >= PASSAGE_RECALL_BAR
