"""`npumoed search`, `similar` and `reindex` on the sample documents, processed by the daemon with the tiny model.

The samples are written from one pool of sentences: every sentence of five of them also appears in another
sample. Text that names one document is therefore a run of two sentences found together only in it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from filelock import FileLock

from npumoe.daemon.cli import main
from npumoe.daemon.cli.search import _print_neighbours, _print_results
from npumoe.daemon.samples import FILENAMES, sample_documents, write_samples
from npumoe.jobs.queue import sqlite
from npumoe.jobs.search.index import Document, Neighbour, _drop_tables
from npumoe.jobs.search.sentence_model import MODEL_KEY

CONFIG = """
[model]
name = "{model}"
chunk_tokens = 128
summary_tokens = 8

[scheduler]
max_foreground_load = 1.0  # other test runs share these cores

[cpu]
threads = 1
background_priority = false
"""


def flat(text: str) -> str:
    return " ".join(text.split())


def identifying_text(filename: str) -> str:
    """The first two consecutive sentences of a sample that appear together in no other sample."""
    others = [flat(" ".join(d.paragraphs)) for d in sample_documents() if d.filename != filename]
    (document,) = (d for d in sample_documents() if d.filename == filename)
    for paragraph in document.paragraphs:
        sentences = re.split(r"(?<=\.) ", paragraph)
        for pair in map(" ".join, pairwise(sentences)):
            if not any(flat(pair) in other for other in others):
                return pair
    raise AssertionError(f"{filename} has no two sentences of its own")


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """A home whose daemon processed the six samples once (`npumoed run --once`)."""
    root = tmp_path_factory.mktemp("search") / "home"
    root.mkdir()
    (root / "config.toml").write_text(CONFIG.format(model=tiny_model))
    inbox = root / "inbox"
    write_samples(inbox)
    done = subprocess.run([sys.executable, "-m", "npumoe.daemon", "run", "--once", "--inbox", str(inbox)],
                          env={**os.environ, "NPUMOED_HOME": str(root)}, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and "6 done" in done.stdout, done.stdout + done.stderr
    return root


def npumoed(home: Path, *args: str) -> Any:
    # A wide terminal: rich folds a path longer than the line (a worker's temporary folder) onto a line of its own.
    result = CliRunner().invoke(main, list(args), env={"NPUMOED_HOME": str(home), "COLUMNS": "200"},
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout) if "--json" in args else result.stdout


@pytest.mark.parametrize("filename", FILENAMES)
def test_text_copied_from_a_sample_finds_it_first_with_the_passage_that_holds_the_text(
        home: Path, filename: str) -> None:
    copied = identifying_text(filename)
    found = npumoed(home, "search", copied, "--json")
    best = found["results"][0]
    assert Path(best["source"]).name == filename
    assert flat(copied) in best["passages"][0]["text"]
    assert best["passages"][0]["phrase"] is True


def test_similar_lists_a_document_itself_first_at_one_then_the_others_ranked(home: Path) -> None:
    for name in FILENAMES:
        found = npumoed(home, "similar", str(home / "inbox" / name), "--json")["similar"]
        assert Path(found[0]["source"]).name == name and found[0]["score"] == pytest.approx(1.0, abs=1e-4)
        assert sorted(Path(d["source"]).name for d in found) == sorted(FILENAMES)
        assert [d["score"] for d in found] == sorted((d["score"] for d in found), reverse=True)


def test_reindex_after_deleting_the_index_gives_the_same_results(home: Path) -> None:
    queries = [identifying_text(name) for name in FILENAMES[:2]] + ["energy budget at night"]
    before = [npumoed(home, "search", q, "--json") for q in queries], npumoed(home, "similar", "1", "--json")
    conn = sqlite.connect(home / "npumoed.db")
    _drop_tables(conn)
    conn.close()
    gone = CliRunner().invoke(main, ["similar", "1"], env={"NPUMOED_HOME": str(home)})
    assert gone.exit_code == 1 and "not in the search index" in gone.output

    assert "indexed 6 document(s)" in npumoed(home, "reindex")
    assert ([npumoed(home, "search", q, "--json") for q in queries], npumoed(home, "similar", "1", "--json")) == before


def test_a_damaged_index_is_named_with_its_remedy_not_a_traceback(home: Path) -> None:
    conn = sqlite.connect(home / "npumoed.db")
    for table in ("search_chunk_vectors_1", "search_document_vectors_1"):  # as a crash mid-write could leave it
        conn.execute(f"DROP TABLE {table}")
    conn.close()
    for command in (["search", "energy budget at night"], ["similar", "1"]):
        damaged = CliRunner().invoke(main, command, env={"NPUMOED_HOME": str(home)})
        assert damaged.exit_code == 1 and isinstance(damaged.exception, SystemExit)  # not an exception of ours
        assert "the search index is damaged" in damaged.output and "npumoed reindex" in damaged.output
        assert "Traceback" not in damaged.output
    assert "indexed 6 document(s)" in npumoed(home, "reindex")


@pytest.mark.slow  # a whole reindex embeds every sample's passages again (~25 s on 2 cores)
def test_reindex_refuses_while_a_daemon_holds_the_home(home: Path) -> None:
    with FileLock(home / "npumoed.lock"):  # as a running daemon holds it
        refused = CliRunner().invoke(main, ["reindex"], env={"NPUMOED_HOME": str(home)})
    assert refused.exit_code == 1 and "npumoed is running" in refused.output and "indexed" not in refused.output
    assert "indexed 6 document(s)" in npumoed(home, "reindex")


@pytest.mark.slow  # a whole reindex embeds every sample's passages again (~25 s on 2 cores)
def test_reindex_reads_the_outbox_folder_the_config_names(home: Path, tmp_path: Path) -> None:
    other = tmp_path / "other home"  # a second home whose outputs go to the first one's outbox
    other.mkdir()
    (other / "config.toml").write_text(f'[outbox]\nfolder = "{home / "outbox"}"\n')
    assert f"indexed 6 document(s) from {home / 'outbox'}" in npumoed(other, "reindex")
    assert Path(npumoed(other, "similar", "1", "--json")["similar"][0]["source"]).parent == home / "inbox"
    (other / "config.toml").write_text(f'[outbox]\nfolder = "{tmp_path / "not mounted"}"\n')
    missing = CliRunner().invoke(main, ["reindex"], env={"NPUMOED_HOME": str(other)})
    assert missing.exit_code == 1 and f"cannot read the outbox {tmp_path / 'not mounted'}" in missing.output
    assert len(npumoed(other, "similar", "1", "--json")["similar"]) == 6  # the index as it was, not emptied


def test_search_prints_documents_with_their_passages(home: Path) -> None:
    copied = identifying_text("battery-budget.html")
    shown = npumoed(home, "search", copied, "-k", "3")
    heading, first_passage = shown.splitlines()[:2]
    assert heading.split()[2] == "battery-budget.html"  # the file name, whole, before its folder
    assert "summary:" not in first_passage and flat(copied)[:40] in flat(first_passage)


def test_names_and_passages_print_as_they_are_not_as_markup(capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"job_id": 3, "source": "/in/[bold]notes[red].txt", "summary": "[red]first[/red] line", "score": 0.9,
             "passages": [{"chunk": 0, "score": 0.9, "text": "A [link=x]tide[/link] came in."},
                          {"chunk": 1, "score": 0.4, "text": None}]}]
    _print_results(rows, ["tide"])
    shown = capsys.readouterr().out
    assert "[bold]notes[red].txt" in shown and "[red]first[/red] line" in shown
    assert "A [link=x]tide[/link] came in." in shown and "(chunk 1: no text kept)" in shown


# -- the query embedded by the search model, here -------------------------------------------------------

# Runs the CLI where importing torch, transformers or the engine's model loading fails, and says which was tried.
BLOCKS_THE_LLM = """import sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers") or name.startswith(
                ("npumoe.engine.api", "npumoe.engine.loading")):
            print(f"blocked: {name}", file=sys.stderr)
            raise ImportError(f"{name} is blocked by the test")
sys.meta_path.insert(0, Blocked())
from npumoe.daemon.cli import main
main(sys.argv[1:])
"""

def test_search_embeds_the_query_itself_without_a_daemon_and_never_imports_the_llm(home: Path) -> None:
    query = identifying_text("paper-archive.pdf")
    env = {**os.environ, "NPUMOED_HOME": str(home)}
    asked = subprocess.run([sys.executable, "-c", BLOCKS_THE_LLM, "search", query, "--json"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert asked.returncode == 0, asked.stderr
    assert "blocked:" not in asked.stderr
    found = json.loads(asked.stdout)
    assert found["model_key"] == MODEL_KEY and Path(found["results"][0]["source"]).name == "paper-archive.pdf"
    assert found == npumoed(home, "search", query, "--json")  # as in a process where torch is loaded


ESCAPES = "\x1b]0;owned\x07\x1b[2J\x9b31m"  # set the window title, clear the screen, a C1 CSI


def test_names_passages_and_summaries_reach_the_terminal_without_escape_sequences(
    capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [{"job_id": 3, "source": f"/in/notes{ESCAPES}.txt", "summary": f"first{ESCAPES} line", "score": 0.9,
             "passages": [{"chunk": 0, "score": 0.9, "text": f"A tide{ESCAPES} came in."}]}]
    _print_results(rows, ["tide"])
    document = Document(job_id=4, source=f"/in/other{ESCAPES}.txt", output_dir="/out/other", summary=ESCAPES)
    _print_neighbours([Neighbour(document=document, score=1.0)])
    shown = capsys.readouterr().out
    assert not {"\x1b", "\x07", "\x9b"} & set(shown)
    assert " notes" in shown and "came in." in shown and "/in/other" in shown
