"""`npumoed bench retrieval`: paraphrased questions about the samples and the written set, searched as `npumoed search`
searches; and the search's default held to what it measured.

The demo model's recall on them is measured with the demo run's vectors, in tests/demo/test_demo_model.py (one file,
so that one worker makes the shared demo run). The command itself, which embeds everything again, runs in
`make chaos`, held to the same bars (demo_run.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.demo_run import ENGINE_WEIGHTS, PASSAGE_RECALL_BAR

from npumoe.bench.cli import bench
from npumoe.bench.service.questions import QUESTIONS, Question, written_set
from npumoe.bench.service.retrieval import SearchModelVectors, compare, flat
from npumoe.daemon.samples import sample_documents
from npumoe.engine.vocabulary import MEAN
from npumoe.jobs.search.index import WEIGHTS
from npumoe.jobs.search.sentence_model import sentence_model

# The search's default (the search model's vectors, WEIGHTS) found the right document first for this share of the
# written set's questions about its first SUBSET documents, by file name, when it was chosen (bench/results/
# retrieval-written-*.json has the whole set).
SUBSET = 6
SUBSET_DOCUMENT_RECALL_AT_1 = 0.889


def words(text: str) -> list[str]:
    return re.findall(r"[\w'-]+", text.lower())


def assert_asked_in_other_words(texts: dict[str, str], questions: tuple[Question, ...]) -> None:
    """Each question's anchor is in its document, and the question copies no three words in a row from it."""
    for q in questions:
        assert flat(q.anchor) in flat(texts[q.filename]), q.anchor
        anchor = words(q.anchor)
        runs = {tuple(anchor[i:i + 3]) for i in range(len(anchor) - 2)}
        asked = words(q.question)
        copied = [run for run in zip(asked, asked[1:], asked[2:], strict=False) if run in runs]
        assert not copied, f"{q.question!r} copies {copied} from its anchor"


def test_each_question_asks_about_a_sentence_of_its_sample_in_other_words() -> None:
    texts = {d.filename: " ".join(d.paragraphs) for d in sample_documents()}
    assert {q.filename for q in QUESTIONS} == set(texts) and len(QUESTIONS) == 4 * len(texts)
    assert_asked_in_other_words(texts, QUESTIONS)


def test_the_written_set_asks_at_least_60_questions_about_at_least_20_documents_in_other_words() -> None:
    texts, questions = written_set()
    assert len(texts) >= 20 and len(questions) >= 60 and {q.filename for q in questions} == set(texts)
    assert_asked_in_other_words(texts, questions)


def test_the_search_default_finds_the_document_first_as_often_as_measured_on_a_fixed_subset() -> None:
    texts, questions = written_set()
    texts = dict(sorted(texts.items())[:SUBSET])
    questions = tuple(q for q in questions if q.filename in texts)
    model = sentence_model()
    before = model.calls
    (default,) = compare([SearchModelVectors(model)], texts, [WEIGHTS], questions)
    assert model.calls > before + len(questions)  # the passages and the questions were embedded here
    assert default.questions == len(questions) == 3 * SUBSET
    assert default.document_recall_at_1 >= SUBSET_DOCUMENT_RECALL_AT_1 > default.document_chance


@pytest.mark.slow  # embeds the six samples again, and the questions, in every pooling
def test_bench_retrieval_prints_its_table_and_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "retrieval.json"
    result = CliRunner().invoke(bench, ["retrieval", "--set", "samples", "--vectors", "engine",
                                        "--pooling", MEAN, "--threads", "1", "--json", str(out)],
                                env={"NPUMOED_HOME": str(tmp_path / "home")}, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "passage R@1" in result.output and "chance:" in result.output
    written = json.loads(out.read_text())
    (default,) = [r for r in written["results"] if r["weights"] == {
        "cosine": ENGINE_WEIGHTS.cosine, "words": ENGINE_WEIGHTS.words, "phrase": ENGINE_WEIGHTS.phrase}]
    assert default["questions"] == len(QUESTIONS)
    assert default["passage_recall_at_1"] >= PASSAGE_RECALL_BAR
