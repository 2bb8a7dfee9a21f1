"""`npumoed bench retrieval`: paraphrased questions about the samples, searched as `npumoed search` searches.

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
from demo_run import PASSAGE_RECALL_BAR

from npumoe.bench.cli import bench
from npumoe.bench.service.questions import QUESTIONS
from npumoe.bench.service.retrieval import flat
from npumoe.daemon.samples import sample_documents
from npumoe.engine.vocabulary import MEAN
from npumoe.jobs.search.index import WEIGHTS


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
