"""The search index: written once a job is done, searched by vector and words, rebuilt from the outbox."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support.sample_meta import document_meta

from npumoe.jobs.outputs import OFFSETS_FILE, SUMMARY_FILE, TEXT_FILE, compressed_text, npy_bytes, write_folder
from npumoe.jobs.queue import sqlite
from npumoe.jobs.queue.store import Queue
from npumoe.jobs.search import index as index_module
from npumoe.jobs.search.index import (
    WEIGHTS,
    IndexEntry,
    NotIndexed,
    OutputsUnreadable,
    SearchIndex,
    engine_vectors,
    reindex,
    write_entry,
    write_local,
)
from npumoe.jobs.search.passages import passage_spans
from npumoe.jobs.search.sentence_model import MODEL_KEY, sentence_model
from npumoe.jobs.summary_file import render_summary

PID = 77
MODEL = "tiny@0"
DIM = 8


def unit(*values: float) -> np.ndarray:
    v = np.zeros(DIM, dtype=np.float32)
    v[: len(values)] = values
    return v / np.linalg.norm(v)


class Home:
    """A queue database and an outbox, with documents done through the queue as the pipeline does it."""

    def __init__(self, root: Path) -> None:
        self.database, self.outbox = root / "npumoed.db", root / "outbox"
        self.outbox.mkdir(parents=True)
        self.queue = Queue(self.database)

    def done(self, name: str, paragraphs: list[str], vectors: list[np.ndarray], *, model_key: str = MODEL,
             settings_key: str = "s", keep_text: bool = True) -> int:
        """A document of one chunk per paragraph, written and completed; returns its job id."""
        job, _ = self.queue.add(f"/in/{name}", name.ljust(64, "0"), model_key=model_key, settings_key=settings_key)
        claimed = self.queue.claim(PID, lease_seconds=60)
        assert claimed is not None and claimed.id == job.id
        folder = self.write(name, job.id, paragraphs, vectors, model_key=model_key, keep_text=keep_text)
        entry = IndexEntry.read(folder, engine_vectors)
        assert self.queue.complete(job.id, PID, output_dir=str(folder))
        write_local(self.database, entry)  # as the pipeline indexes it: after the job is done
        return job.id

    def write(self, name: str, job_id: int, paragraphs: list[str], vectors: list[np.ndarray], *,
              model_key: str = MODEL, keep_text: bool = True) -> Path:
        text = "\n\n".join(paragraphs)
        starts = [text.index(p) for p in paragraphs]
        spans = np.array([[s, s + len(p)] for s, p in zip(starts, paragraphs, strict=True)], dtype=np.int64)
        rows = np.stack([*vectors, unit(*np.mean(vectors, axis=0))])
        files = {SUMMARY_FILE: render_summary(name, model_key, len(paragraphs), 10, f"About {name}.\nMore.").encode(),
                 "embeddings.npy": npy_bytes(rows),
                 "meta.json": document_meta(job_id=job_id, model_key=model_key, source=f"/in/{name}").to_json()}
        if keep_text:
            files |= {OFFSETS_FILE: npy_bytes(spans), TEXT_FILE: compressed_text(text)}
        return write_folder(self.outbox, name, files)

    def search(self, query: str, vector: np.ndarray, k: int = 10) -> list[tuple[str, int, float]]:
        index = SearchIndex(self.database)
        try:
            return [(Path(hits.document.source).name, chunk.ordinal, round(chunk.score, 5))
                    for hits in index.search(MODEL, vector, query, k) for chunk in hits.chunks]
        finally:
            index.close()

    def similar(self, job_id: int) -> list[tuple[str, float]]:
        index = SearchIndex(self.database)
        try:
            return [(Path(n.document.source).name, round(n.score, 5)) for n in index.similar(job_id, 10)]
        finally:
            index.close()

    def count(self, table: str) -> int:
        conn = sqlite.connect(self.database, read_only=True)
        try:
            return conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
        finally:
            conn.close()


@pytest.fixture
def home(tmp_path: Path) -> Home:
    return Home(tmp_path)


@pytest.fixture
def archive(home: Home) -> Home:
    home.done("tides.txt", ["The tide came in at dusk and the boats rocked.", "Gulls watched the harbour wall."],
              [unit(1, 0), unit(1, 0.2)])
    home.done("orchard.txt", ["Apples ripened slowly in the late sun.", "The boats of the orchard are baskets."],
              [unit(0, 1), unit(0.3, 1)])
    home.done("ledger.txt", ["Accounts were settled at the end of the month."], [unit(0.5, 0.5, 1)])
    return home


def test_a_completed_job_is_searchable_by_vector(archive: Home) -> None:
    hits = archive.search("zzz", unit(0, 1, 0.01))  # no word matches: the vectors alone rank
    assert hits[0][:2] == ("orchard.txt", 0) and hits[1][:2] == ("orchard.txt", 1)
    assert [name for name, _, _ in hits][2:] == ["ledger.txt", "tides.txt", "tides.txt"]
    assert hits[0][2] == pytest.approx(WEIGHTS.cosine * float(unit(0, 1) @ unit(0, 1, 0.01)), abs=1e-5)


def test_the_query_words_outrank_vectors_and_the_exact_phrase_outranks_scattered_words(archive: Home) -> None:
    far = unit(0, 0, 0, 1)  # orthogonal to every chunk: cosine 0 everywhere
    assert archive.search("harbour wall", far)[0][:2] == ("tides.txt", 1)
    exact, scattered = archive.search("boats rocked", far)[0], archive.search("rocked boats", far)[0]
    assert exact[:2] == scattered[:2] == ("tides.txt", 0)
    assert exact[2] == pytest.approx(WEIGHTS.words + WEIGHTS.phrase)  # all words, in order
    assert scattered[2] == pytest.approx(WEIGHTS.words)  # all words, out of order


def test_k_limits_the_chunks_returned(archive: Home) -> None:
    assert len(archive.search("boats", unit(1, 0), k=2)) == 2


def test_a_document_is_indexed_with_its_summarys_first_line(archive: Home) -> None:
    index = SearchIndex(archive.database)
    try:
        assert index.document(1).summary == "About tides.txt."
    finally:
        index.close()


def test_similar_lists_the_document_itself_first_at_one_then_the_nearest(archive: Home) -> None:
    found = archive.similar(1)
    assert found[0] == ("tides.txt", pytest.approx(1.0, abs=1e-5))
    assert [name for name, _ in found] == ["tides.txt", "ledger.txt", "orchard.txt"]
    assert found[1][1] > found[2][1]


def test_a_failing_index_write_leaves_the_index_unchanged(home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    home.done("before.txt", ["Already here."], [unit(1)])
    folder = home.write("a.txt", 2, ["Some words."], [unit(1)])
    entry = IndexEntry.read(folder, engine_vectors)

    def write_then_fail(conn: sqlite.Connection, entry: IndexEntry) -> None:
        write_entry(conn, entry)
        raise OSError("disk full")

    monkeypatch.setattr(index_module, "write_entry", write_then_fail)
    with pytest.raises(OSError, match="disk full"):
        write_local(home.database, entry)
    assert home.count("search_documents") == 1 and home.count("search_chunks") == 1


def test_a_rerun_replaces_its_rows_and_a_job_that_takes_over_a_folder_replaces_the_old_jobs(home: Home) -> None:
    first = home.done("a.txt", ["Old words here.", "More old words."], [unit(1), unit(1, 1)])
    folder = home.write("a.txt", first, ["New words."], [unit(0, 1)])
    conn = sqlite.connect(home.database)
    try:
        conn.execute("BEGIN IMMEDIATE")
        write_entry(conn, IndexEntry.read(folder, engine_vectors))  # the same job indexed again
        conn.execute("COMMIT")
    finally:
        conn.close()
    assert home.count("search_documents") == 1 and home.count("search_chunks") == 1
    assert home.search("old", unit(0, 1))[0][:2] == ("a.txt", 0) and len(home.search("old", unit(0, 1))) == 1
    second = home.done("a.txt", ["Newer words."], [unit(0, 0, 1)], settings_key="other")  # same content, same folder
    assert home.count("search_documents") == 1 and home.similar(second)[0][0] == "a.txt"
    with pytest.raises(NotIndexed):
        home.similar(first)


def test_reindex_after_deleting_the_index_gives_the_same_results(archive: Home) -> None:
    queries = [("harbour", unit(1, 0)), ("boats", unit(0, 1)), ("zzz", unit(0.5, 0.5, 1))]
    before = [archive.search(q, v) for q, v in queries], [archive.similar(j) for j in (1, 2, 3)]
    conn = sqlite.connect(archive.database)
    index_module._drop_tables(conn)
    conn.close()
    with pytest.raises(NotIndexed):
        archive.similar(1)
    done = reindex(archive.database, archive.outbox, engine_vectors)
    assert (done.documents, done.skipped) == (3, [])
    assert ([archive.search(q, v) for q, v in queries], [archive.similar(j) for j in (1, 2, 3)]) == before


def test_reindex_skips_unreadable_folders_and_names_them(archive: Home) -> None:
    (archive.outbox / "broken").mkdir()
    (archive.outbox / ".tmp-half-written").mkdir()
    done = reindex(archive.database, archive.outbox, engine_vectors)
    assert done.documents == 3 and len(done.skipped) == 1 and "broken" in done.skipped[0]


def test_outputs_from_before_text_was_kept_are_indexed_by_their_vectors(home: Home) -> None:
    job = home.done("old.txt", ["Words nobody can search."], [unit(1)], keep_text=False)
    assert home.search("words", unit(1)) == [("old.txt", 0, pytest.approx(WEIGHTS.cosine))]
    index = SearchIndex(home.database)
    chunk = index.search(MODEL, unit(1), "words", 1)[0].chunks[0]
    index.close()
    assert (chunk.start, chunk.end, chunk.words) == (None, None, 0.0) and job == 1


def test_models_do_not_mix(archive: Home) -> None:
    archive.done("other.txt", ["The boats again."], [unit(1, 0, 0, 0, 0, 0, 1, 0)], model_key="other@1")
    assert {name for name, _, _ in archive.search("boats", unit(1, 0))} == {"tides.txt", "orchard.txt", "ledger.txt"}
    index = SearchIndex(archive.database)
    try:
        assert index.models() == {MODEL: 3, "other@1": 1}
        with pytest.raises(NotIndexed, match="no documents are indexed for model unknown@2"):
            index.search("unknown@2", unit(1), "boats", 5)
    finally:
        index.close()


def test_a_folder_whose_embeddings_do_not_match_its_offsets_is_refused(home: Home) -> None:
    folder = home.write("a.txt", 1, ["One.", "Two."], [unit(1), unit(0, 1)])
    (folder / OFFSETS_FILE).write_bytes(npy_bytes(np.zeros((3, 2), dtype=np.int64)))
    with pytest.raises(OutputsUnreadable, match="one span per chunk"):
        IndexEntry.read(folder, engine_vectors)


def test_by_default_a_document_is_indexed_by_the_search_model_over_its_passages(home: Home) -> None:
    paragraphs = ["The tide came in at dusk and the boats rocked.", "Gulls watched the harbour wall. " * 60]
    folder = home.write("tides.txt", 1, paragraphs, [unit(1), unit(0, 1)])
    text = "\n\n".join(paragraphs)
    model = sentence_model()
    before = model.calls
    entry = IndexEntry.read(folder)
    assert entry.model_key == MODEL_KEY and entry.spans.tolist() == [list(s) for s in passage_spans(text)]
    assert len(entry.chunks) == len(passage_spans(text)) > 1 and model.calls == before + len(entry.chunks)
    assert np.allclose(entry.chunks, model.embed([text[a:b] for a, b in passage_spans(text)]), atol=1e-5)


def test_the_search_model_cannot_index_outputs_without_their_text(home: Home) -> None:
    folder = home.write("old.txt", 1, ["Words nobody kept."], [unit(1)], keep_text=False)
    with pytest.raises(OutputsUnreadable, match="no text kept"):
        IndexEntry.read(folder)


def test_reindex_rebuilds_the_index_with_the_search_models_vectors(archive: Home) -> None:
    done = reindex(archive.database, archive.outbox)
    assert (done.documents, done.skipped) == (3, [])
    index = SearchIndex(archive.database)
    try:
        assert index.models() == {MODEL_KEY: 3}
        query = "When did the fruit on the trees become ready to pick?"
        found = index.search(MODEL_KEY, sentence_model().embed([query])[0], query, 3)
    finally:
        index.close()
    assert Path(found[0].document.source).name == "orchard.txt" and found[0].chunks[0].cosine > 0.3


@pytest.mark.parametrize("home_name", ["h#9", "h?mode=rwc", "h%41"])
def test_a_read_only_connection_opens_the_database_of_a_home_whose_name_reads_as_url_syntax(
        tmp_path: Path, home_name: str) -> None:
    database = tmp_path / home_name / "npumoed.db"
    database.parent.mkdir()
    writer = sqlite.connect(database)
    writer.execute("CREATE TABLE marker (word TEXT)")
    writer.execute("INSERT INTO marker VALUES ('this home')")
    writer.close()
    before = sorted(p.name for p in tmp_path.iterdir())

    reader = sqlite.connect(database, read_only=True)
    assert reader.execute("SELECT word FROM marker").fetchall() == [("this home",)]
    reader.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no other database made beside the home
