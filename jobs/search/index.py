"""The search index: every done document's chunk and document vectors, and its chunks' words.

The vectors are the search model's (sentence_model.py) over ~200-word passages of the document's text, not the
engine's prefill vectors (embeddings.npy, still written for the person): the retrieval benchmark measured the
search model better, and a query then embeds in milliseconds without the LLM. `engine_vectors` indexes the
engine's own, for that benchmark and for the index's tests.

It lives in the home's SQLite database beside the queue, and a document enters it right after its job is
marked done, in a transaction of its own: the index is derived, so damage to it must not fail documents. A
write that fails flags the index (`mark_stale`) until `reindex` has rebuilt it. Its tables:

    search_models         one row per model (and pooling, `vectors_key`) whose vectors are indexed: vectors of
                          two models, or of one model pooled two ways, never mix
    search_documents      one row per done job: output folder, source, the summary's first line
    search_chunks         one row per chunk: its document and its [start, end) characters in the text
    search_words          FTS5 over each chunk's whole sentences; contentless, as the text stays in the outbox
    search_chunk_vectors_<m>, search_document_vectors_<m>   sqlite-vec vec0 tables of model m, cosine

Everything here is built from an output folder (`IndexEntry.read`), so `reindex` rebuilds exactly
what the daemon wrote.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from npumoe.engine.generate.sentences import sentence_spans
from npumoe.engine.vocabulary import MEAN

from ..meta import read_meta
from ..outputs import EMBEDDINGS_FILE, OFFSETS_FILE, TMP_PREFIX, read_text
from ..queue import sqlite
from ..summary_file import read_summary
from .passages import passage_spans, query_terms, widened_to_sentences

if TYPE_CHECKING:
    from .sentence_model import SentenceModel

log = logging.getLogger(__name__)
STALE_SUFFIX = "-reindex"

@dataclass(frozen=True)
class Weights:
    """What a chunk's score, in [0, 1], is made of: how close its vector is to the query's (cosine similarity), how
    much of the query's words its sentences hold (their IDF-weighted share), whether they hold the query word for
    word. They add up to 1."""

    cosine: float
    words: float
    phrase: float


# Three quarters the search model's vectors, an eighth each the words and the phrase: the best of the weightings
# `npumoed bench retrieval` measured on its written question set (docs/benchmarks.md, Retrieval); the words decide
# where the vectors cannot tell two passages apart.
WEIGHTS = Weights(cosine=0.75, words=0.125, phrase=0.125)
CANDIDATES = 100  # chunks taken from each of the two searches before scoring, at least
MAX_KNN = 4096  # sqlite-vec's limit on k

TABLES = [
    """CREATE TABLE IF NOT EXISTS search_models (
        id INTEGER PRIMARY KEY, model_key TEXT NOT NULL UNIQUE, dim INTEGER NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS search_documents (
        job_id INTEGER PRIMARY KEY, model_id INTEGER NOT NULL REFERENCES search_models (id),
        output_dir TEXT NOT NULL UNIQUE, source TEXT NOT NULL, summary TEXT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS search_chunks (
        id INTEGER PRIMARY KEY, job_id INTEGER NOT NULL REFERENCES search_documents (job_id),
        ordinal INTEGER NOT NULL, start INTEGER, "end" INTEGER)""",
    "CREATE INDEX IF NOT EXISTS search_chunks_job ON search_chunks (job_id)",
    """CREATE VIRTUAL TABLE IF NOT EXISTS search_words USING fts5(
        text, content='', contentless_delete=1, tokenize='unicode61 remove_diacritics 2')""",
]


class OutputsUnreadable(ValueError):
    """An output folder whose files cannot be indexed (missing, or not what the daemon writes)."""


@dataclass(frozen=True)
class Vectors:
    """A document's vectors as the index keeps them: one per chunk, one for the whole document."""

    model_key: str  # a `vectors_key`
    chunks: np.ndarray  # float32 (n, dim)
    document: np.ndarray  # float32 (dim,)
    spans: np.ndarray | None  # int64 (n, 2) character offsets; None for outputs from before they were kept


# How a document's vectors are made from its output folder, its meta.json and its text (None when not kept).
VectorSource = Callable[[Path, dict[str, Any], str | None], Vectors]


def search_model_vectors(folder: Path, meta: dict[str, Any], text: str | None) -> Vectors:
    """The search model's vectors (sentence_model.py) of the text's ~200-word passages: the index's default,
    chosen by measurement (docs/benchmarks.md, Retrieval)."""
    from .sentence_model import MODEL_KEY, sentence_model

    if text is None or not passage_spans(text):
        raise OutputsUnreadable(f"{folder}: no text kept to search (outputs from an older npumoed: process it again)")
    return Vectors(MODEL_KEY, *embedded_passages(text, sentence_model()))


def embedded_passages(text: str, model: SentenceModel) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(one vector per ~200-word passage of `text`, the document's vector: their normalised mean, the passages'
    character spans) by `model`."""
    spans = passage_spans(text)
    chunks = model.embed([text[a:b] for a, b in spans])
    mean = chunks.mean(axis=0)
    return chunks, (mean / np.linalg.norm(mean)).astype(np.float32), np.array(spans, dtype=np.int64)


def engine_vectors(folder: Path, meta: dict[str, Any], text: str | None) -> Vectors:
    """The engine's own vectors, pooled from the prefill (embeddings.npy, offsets.npy): what the retrieval
    benchmark compares the search model with."""
    rows = np.load(folder / EMBEDDINGS_FILE).astype(np.float32)
    spans = np.load(folder / OFFSETS_FILE) if (folder / OFFSETS_FILE).exists() else None
    if rows.ndim != 2 or len(rows) < 2:
        raise OutputsUnreadable(f"{folder}: {EMBEDDINGS_FILE} holds {rows.shape}, not chunk rows and a document row")
    if spans is not None and spans.shape != (len(rows) - 1, 2):
        raise OutputsUnreadable(f"{folder}: {OFFSETS_FILE} holds {spans.shape}, not one span per chunk")
    key = vectors_key(meta["model_key"], meta.get("embeddings", {}).get("pooling", MEAN))
    return Vectors(key, rows[:-1], rows[-1], spans)


@dataclass(frozen=True)
class IndexEntry:
    """What the index holds of one document, read from its output folder."""

    job_id: int
    model_key: str
    output_dir: str
    source: str
    summary: str  # the summary's first line
    chunks: np.ndarray  # float32 (n, dim)
    document: np.ndarray  # float32 (dim,)
    spans: np.ndarray | None  # int64 (n, 2) character offsets; None for outputs from before they were kept
    text: str | None  # the extracted text; None likewise

    @classmethod
    def read(cls, folder: Path, vectors: VectorSource = search_model_vectors) -> IndexEntry:
        try:
            meta = read_meta(folder)
            summary = read_summary(folder).first_line
            text = read_text(folder)
            made = vectors(folder, meta, text)
        except OutputsUnreadable:
            raise
        except (OSError, ValueError) as e:
            raise OutputsUnreadable(f"{folder}: {e}") from e
        return cls(meta["job_id"], made.model_key, str(folder), meta["source"], summary,
                   made.chunks, made.document, made.spans, text)


def vectors_key(model_key: str, pooling: str) -> str:
    """The key the index keeps one model's vectors of one pooling under: the model's own for mean pooling (as
    before there was a choice), with the pooling after it otherwise."""
    return model_key if pooling == MEAN else f"{model_key}#{pooling}"


def create_tables(conn: sqlite.Connection) -> None:
    for statement in TABLES:
        conn.execute(statement)


def write_entry(conn: sqlite.Connection, entry: IndexEntry) -> None:
    """Index one document, replacing what its job, or an earlier job whose folder it took over, had there."""
    create_tables(conn)
    model_id = _model_id(conn, entry.model_key, entry.chunks.shape[1])
    replaced = conn.execute("SELECT job_id FROM search_documents WHERE job_id = ? OR output_dir = ?",
                            (entry.job_id, entry.output_dir)).fetchall()
    for (job_id,) in replaced:
        _remove(conn, job_id)
    conn.execute("INSERT INTO search_documents (job_id, model_id, output_dir, source, summary) VALUES (?, ?, ?, ?, ?)",
                 (entry.job_id, model_id, entry.output_dir, entry.source, entry.summary))
    chunk_ids = []
    for ordinal in range(len(entry.chunks)):
        span = entry.spans[ordinal].tolist() if entry.spans is not None else [None, None]
        chunk_ids.append(conn.execute('INSERT INTO search_chunks (job_id, ordinal, start, "end") VALUES (?, ?, ?, ?)',
                                      (entry.job_id, ordinal, *span)).lastrowid)
    conn.executemany(f"INSERT INTO search_chunk_vectors_{model_id} (rowid, embedding) VALUES (?, ?)",
                     [(i, row.tobytes()) for i, row in zip(chunk_ids, entry.chunks, strict=True)])
    conn.execute(f"INSERT INTO search_document_vectors_{model_id} (rowid, embedding) VALUES (?, ?)",
                 (entry.job_id, entry.document.tobytes()))
    if entry.text is not None and entry.spans is not None:
        sentences = sentence_spans(entry.text)
        words = [entry.text[slice(*widened_to_sentences(sentences, a, b))] for a, b in entry.spans.tolist()]
        conn.executemany("INSERT INTO search_words (rowid, text) VALUES (?, ?)", zip(chunk_ids, words, strict=True))


def _model_id(conn: sqlite.Connection, model_key: str, dim: int) -> int:
    found = conn.execute("SELECT id, dim FROM search_models WHERE model_key = ?", (model_key,)).fetchone()
    if found is not None:
        if found[1] != dim:
            raise OutputsUnreadable(f"{model_key} is indexed at {found[1]} dimensions, this document has {dim}")
        return found[0]
    model_id = conn.execute("INSERT INTO search_models (model_key, dim) VALUES (?, ?)", (model_key, dim)).lastrowid
    for kind in ("chunk", "document"):
        conn.execute(f"CREATE VIRTUAL TABLE search_{kind}_vectors_{model_id} "
                     f"USING vec0(embedding float[{dim}] distance_metric=cosine)")
    return model_id


def _remove(conn: sqlite.Connection, job_id: int) -> None:
    (model_id,) = conn.execute("SELECT model_id FROM search_documents WHERE job_id = ?", (job_id,)).fetchone()
    chunk_ids = [(i,) for (i,) in conn.execute("SELECT id FROM search_chunks WHERE job_id = ?", (job_id,))]
    conn.executemany(f"DELETE FROM search_chunk_vectors_{model_id} WHERE rowid = ?", chunk_ids)
    conn.executemany("DELETE FROM search_words WHERE rowid = ?", chunk_ids)
    conn.execute("DELETE FROM search_chunks WHERE job_id = ?", (job_id,))
    conn.execute(f"DELETE FROM search_document_vectors_{model_id} WHERE rowid = ?", (job_id,))
    conn.execute("DELETE FROM search_documents WHERE job_id = ?", (job_id,))


@dataclass(frozen=True)
class Reindexed:
    documents: int
    skipped: list[str]  # output folders that could not be read, with the reason


@contextmanager
def _writing(database: Path) -> Iterator[sqlite.Connection]:
    """A connection to `database` inside one write transaction: committed when the block ends, rolled back when
    it raises."""
    conn = sqlite.connect(database)
    try:
        conn.execute("BEGIN IMMEDIATE")
        yield conn
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    finally:
        conn.close()


def write_local(database: Path, entry: IndexEntry) -> None:
    """Index one document in this machine's own database, in a transaction of its own: what a worker does when
    the queue lives elsewhere (a shared PostgreSQL queue), so each machine's index holds the documents it made."""
    with _writing(database) as conn:
        write_entry(conn, entry)


def stale_marker(database: Path) -> Path:
    """The file beside `database` that says its index misses documents, and why: a file, since the database
    itself may be what refused the write."""
    return database.with_name(f"{database.name}{STALE_SUFFIX}")


def mark_stale(database: Path, why: str) -> None:
    """Flag the index of `database` for `reindex`: the first reason is kept (it says when it began)."""
    marker = stale_marker(database)
    try:
        with open(marker, "x", encoding="utf-8") as f:
            f.write(why + "\n")
    except FileExistsError:
        pass
    except OSError as e:  # a disk too full for even that: the log says it
        log.warning("could not flag the search index for `npumoed reindex`: %s", e)


def stale_reason(database: Path) -> str | None:
    """Why the index of `database` misses documents, when it was flagged; None when it is whole."""
    try:
        return stale_marker(database).read_text(encoding="utf-8").strip()
    except OSError:
        return None


def reindex(database: Path, outbox: Path, vectors: VectorSource = search_model_vectors) -> Reindexed:
    """Drop the index and build it again from every output folder, in one transaction: a search meanwhile sees
    the old index whole, then the new one."""
    documents, skipped = 0, []
    with _writing(database) as conn:
        _drop_tables(conn)
        create_tables(conn)
        for folder in sorted(outbox.iterdir()):
            if not folder.is_dir() or folder.name.startswith(TMP_PREFIX):
                continue
            try:
                write_entry(conn, IndexEntry.read(folder, vectors))
                documents += 1
            except OutputsUnreadable as e:
                skipped.append(str(e))
    stale_marker(database).unlink(missing_ok=True)
    return Reindexed(documents, skipped)


def _drop_tables(conn: sqlite.Connection) -> None:
    """Drop every search_ table: the virtual ones first, which take their shadow tables with them."""
    names = [name for (name,) in conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name LIKE 'search\\_%' ESCAPE '\\' "
        "ORDER BY sql NOT LIKE 'CREATE VIRTUAL%'")]
    for name in names:
        if conn.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (name,)).fetchone():
            conn.execute(f'DROP TABLE "{name}"')


# -- reading -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Document:
    job_id: int
    source: str
    output_dir: str
    summary: str


@dataclass(frozen=True)
class ChunkHit:
    chunk_id: int
    ordinal: int
    start: int | None
    end: int | None
    score: float
    cosine: float
    words: float  # the IDF-weighted share of the query's words that the chunk's sentences hold
    phrase: bool  # whether they hold the query word for word


@dataclass(frozen=True)
class DocumentHits:
    document: Document
    chunks: list[ChunkHit]  # best first

    @property
    def score(self) -> float:
        return self.chunks[0].score


@dataclass(frozen=True)
class Neighbour:
    document: Document
    score: float  # cosine similarity of the document vectors


class NotIndexed(LookupError):
    """Nothing to search: no document of this model, or the document asked about, is in the index."""


class IndexDamaged(Exception):
    """The index cannot be read (a table or row missing, a page damaged); `npumoed reindex` rebuilds it."""


def _reading(method: Callable[..., Any]) -> Callable[..., Any]:
    """A read of the index whose database errors are IndexDamaged, naming the remedy."""

    @functools.wraps(method)
    def read(self: SearchIndex, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except sqlite.driver.DatabaseError as e:
            if getattr(e, "sqlite_errorname", "").startswith(("SQLITE_BUSY", "SQLITE_LOCKED")):
                raise  # a writer held on too long: nothing is damaged
            raise _damaged(str(e)) from e

    return read


def _damaged(why: str) -> IndexDamaged:
    return IndexDamaged(f"the search index is damaged ({why}); `npumoed reindex` rebuilds it from the outbox")


def _one(cursor: Any, what: str) -> Any:
    """The row that the index's other tables say is there."""
    row = cursor.fetchone()
    if row is None:
        raise _damaged(f"no {what}")
    return row


class SearchIndex:
    """Reads the index (read-only): the best chunks for a query, and a document's nearest documents."""

    def __init__(self, database: Path) -> None:
        self.conn = sqlite.connect(database, read_only=True)

    def close(self) -> None:
        self.conn.close()

    @_reading
    def models(self) -> dict[str, int]:
        """model_key -> number of documents indexed with it."""
        if not self._exists("search_models"):
            return {}
        return dict(self.conn.execute(
            "SELECT m.model_key, count(d.job_id) FROM search_models m "
            "LEFT JOIN search_documents d ON d.model_id = m.id GROUP BY m.id"))

    @_reading
    def search(self, model_key: str, vector: np.ndarray, query: str, k: int,
               weights: Weights = WEIGHTS) -> list[DocumentHits]:
        """The k best chunks for the query among the documents of `model_key` (a `vectors_key`), grouped by
        document in order of their best chunk. `vector` is the query embedded by that model (`SentenceModel.embed`, or
        `Engine.embed` for the engine's own vectors)."""
        model_id = self._model(model_key)
        vector = np.asarray(vector, dtype=np.float32)
        candidates = max(CANDIDATES, 4 * k)
        cosines = dict(self.conn.execute(
            f"SELECT rowid, 1 - distance FROM search_chunk_vectors_{model_id} WHERE embedding MATCH ? AND k = ?",
            (vector.tobytes(), min(candidates, MAX_KNN))))
        words, phrase = self._lexical(model_id, query, candidates)
        for chunk_id in (words.keys() | phrase) - cosines.keys():
            (blob,) = _one(self.conn.execute(f"SELECT embedding FROM search_chunk_vectors_{model_id} WHERE rowid = ?",
                                             (chunk_id,)), f"vector of chunk {chunk_id}")
            cosines[chunk_id] = _cosine(np.frombuffer(blob, dtype=np.float32), vector)
        scores = {i: weights.cosine * cos + weights.words * words.get(i, 0.0) + weights.phrase * (i in phrase)
                  for i, cos in cosines.items()}
        grouped: dict[int, list[ChunkHit]] = {}
        for chunk_id in sorted(scores, key=lambda i: (-scores[i], i))[:k]:
            job_id, ordinal, start, end = _one(self.conn.execute(
                'SELECT job_id, ordinal, start, "end" FROM search_chunks WHERE id = ?', (chunk_id,)),
                f"chunk {chunk_id}")
            grouped.setdefault(job_id, []).append(ChunkHit(
                chunk_id, ordinal, start, end, scores[chunk_id], cosines[chunk_id], words.get(chunk_id, 0.0),
                chunk_id in phrase))
        return [DocumentHits(self.document(job_id), hits) for job_id, hits in grouped.items()]

    def _lexical(self, model_id: int, query: str, candidates: int) -> tuple[dict[int, float], set[int]]:
        """For the chunks of this model that match the query's words best: chunk id -> the IDF-weighted share of
        the query's words it holds; and the chunks that hold the query word for word.

        IDF as BM25 has it, ln(1 + (N - n + 0.5) / (n + 0.5)) over all N indexed chunks: a word in every chunk
        weighs almost nothing, a rare one a lot."""
        terms = query_terms(query)
        if not terms or not self._exists("search_words"):
            return {}, set()
        of_model = ("SELECT w.rowid FROM search_words w JOIN search_chunks c ON c.id = w.rowid "
                    "JOIN search_documents d ON d.job_id = c.job_id WHERE search_words MATCH ? AND d.model_id = ? "
                    "ORDER BY bm25(search_words) LIMIT ?")
        phrase = {i for (i,) in self.conn.execute(of_model, (_quoted(query), model_id, candidates))}
        terms = [_quoted(term) for term in terms]
        found = [i for (i,) in self.conn.execute(of_model, (" OR ".join(terms), model_id, candidates))]
        if not found:
            return {}, phrase
        total = self.conn.execute("SELECT count(*) FROM search_chunks").fetchone()[0]
        weights = [math.log(1 + (total - n + 0.5) / (n + 0.5)) for n in (
            self.conn.execute("SELECT count(*) FROM search_words WHERE search_words MATCH ?", (t,)).fetchone()[0]
            for t in terms)]
        marks = ",".join("?" * len(found))
        shares = dict.fromkeys(found, 0.0)
        holding = f"SELECT rowid FROM search_words WHERE search_words MATCH ? AND rowid IN ({marks})"
        for term, weight in zip(terms, weights, strict=True):
            for (chunk_id,) in self.conn.execute(holding, (term, *found)):
                shares[chunk_id] += weight / sum(weights)
        return shares, phrase

    @_reading
    def similar(self, job_id: int, k: int) -> list[Neighbour]:
        """The k documents of the same model nearest to document `job_id`'s vector: itself first."""
        row = self._exists("search_documents") and self.conn.execute(
            "SELECT model_id FROM search_documents WHERE job_id = ?", (job_id,)).fetchone()
        if not row:
            raise NotIndexed(f"job {job_id} is not in the search index (not done, or run `npumoed reindex`)")
        (model_id,) = row
        (blob,) = _one(self.conn.execute(f"SELECT embedding FROM search_document_vectors_{model_id} WHERE rowid = ?",
                                         (job_id,)), f"vector of document {job_id}")
        found = self.conn.execute(
            f"SELECT rowid, 1 - distance FROM search_document_vectors_{model_id} WHERE embedding MATCH ? AND k = ?",
            (blob, min(k, MAX_KNN))).fetchall()
        return [Neighbour(self.document(other), score) for other, score in found]

    def document(self, job_id: int) -> Document:
        row = self.conn.execute("SELECT job_id, source, output_dir, summary FROM search_documents WHERE job_id = ?",
                                (job_id,)).fetchone()
        if row is None:
            raise NotIndexed(f"job {job_id} is not in the search index")
        return Document(*row)

    def _model(self, model_key: str) -> int:
        row = self._exists("search_models") and self.conn.execute(
            "SELECT id FROM search_models WHERE model_key = ?", (model_key,)).fetchone()
        if not row:
            indexed = ", ".join(self.models()) or "none"
            raise NotIndexed(f"no documents are indexed for model {model_key} (indexed models: {indexed}); "
                             "`npumoed reindex` indexes the outbox with the search model")
        return row[0]

    def _exists(self, table: str) -> bool:
        return self.conn.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (table,)).fetchone() is not None


def _quoted(text: str) -> str:
    """`text` as one FTS5 phrase: its own tokenizer splits it into words, which must follow one another."""
    return '"' + text.replace('"', '""') + '"'


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
