"""Retrieval: do paraphrased questions find the passage and the document that answer them?

For each way of making vectors (`VectorMaker`: the engine's, pooled from its prefill, or the search model's over
~200-word passages), the documents are embedded as the daemon would and indexed through the daemon's own write
path (`write_entry`, with their words); each question is embedded the same way and searched (`SearchIndex.search`)
under each weighting of vectors against words. A passage answers when its sentences hold the question's anchor, a
document when its text does. Reported: recall@1 and recall@3 (the first result, one of the first three, answers)
and MRR (the mean of 1 / the rank of the first result that answers) for passages and for documents, and what
chance would score. Two question sets: the six samples' (questions.QUESTIONS) and the written set of
bench/retrieval_set (questions.written_set), twenty-odd documents of many kinds.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from npumoe.daemon.samples import write_samples
from npumoe.engine.generate.sentences import sentence_spans
from npumoe.engine.vocabulary import MEAN
from npumoe.jobs.extract.isolated import extract_text
from npumoe.jobs.queue import sqlite
from npumoe.jobs.search.index import (
    DocumentHits,
    IndexEntry,
    SearchIndex,
    Weights,
    embedded_passages,
    vectors_key,
    write_entry,
)
from npumoe.jobs.search.passages import widened_to_sentences
from npumoe.jobs.search.sentence_model import SentenceModel

from .questions import QUESTIONS, Question

# Vectors only, then ever more of the words, to words only; words and phrase share the rest equally, as now.
WEIGHTINGS = tuple(Weights(cosine, (1 - cosine) / 2, (1 - cosine) / 2) for cosine in (1.0, 0.75, 0.5, 0.25, 0.0))


class Embedder(Protocol):
    """What is measured: the engine's two embedding calls (`Engine`)."""

    model_key: str

    def embed(self, text: str, pooling: str | None = None) -> np.ndarray: ...

    def embed_document(self, text: str, pooling: str | None = None) -> tuple[np.ndarray, np.ndarray]: ...


class VectorMaker(Protocol):
    """One way of making the index's vectors: a document's chunk rows and its document row, with the chunks'
    character spans; and a query's vector."""

    name: str  # as the table shows it
    pooling: str

    def document(self, text: str) -> tuple[np.ndarray, np.ndarray]: ...

    def query(self, text: str) -> np.ndarray: ...


@dataclass(frozen=True)
class EngineVectors:
    """The engine's own vectors, pooled from its prefill of token-cut chunks (what embeddings.npy holds)."""

    engine: Embedder
    pooling: str

    @property
    def name(self) -> str:
        return vectors_key(self.engine.model_key, self.pooling)

    def document(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        return self.engine.embed_document(text, self.pooling)

    def query(self, text: str) -> np.ndarray:
        return self.engine.embed(text, self.pooling)


@dataclass(frozen=True)
class SearchModelVectors:
    """The search model's vectors of whole-sentence passages, as the index makes them (`search_model_vectors`)."""

    model: SentenceModel
    pooling: str = MEAN

    @property
    def name(self) -> str:
        return self.model.model_key

    def document(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        chunks, document, spans = embedded_passages(text, self.model)
        return np.vstack([chunks, document]), spans

    def query(self, text: str) -> np.ndarray:
        return self.model.embed([text])[0]


@dataclass(frozen=True)
class Retrieval:
    pooling: str
    weights: Weights
    questions: int
    passage_recall_at_1: float
    passage_mrr: float
    document_recall_at_1: float
    document_mrr: float
    passage_chance: float  # recall@1 of a random ranking: the mean share of chunks that answer
    document_chance: float
    vectors: str = ""  # the VectorMaker's name
    passage_recall_at_3: float = 0.0
    document_recall_at_3: float = 0.0


def sample_texts() -> dict[str, str]:
    """Each sample's text as the daemon extracts it, by file name."""
    with tempfile.TemporaryDirectory() as folder:
        return {path.name: extract_text(path).text for path in write_samples(Path(folder))}


def flat(text: str) -> str:
    return " ".join(text.split())


def measure(engine: Embedder, texts: dict[str, str], poolings: Sequence[str],
            weightings: Sequence[Weights] = WEIGHTINGS,
            questions: Sequence[Question] = QUESTIONS) -> list[Retrieval]:
    """One row per pooling of the engine's vectors and weighting; `texts` maps each file name to its text."""
    return compare([EngineVectors(engine, pooling) for pooling in poolings], texts, weightings, questions)


def compare(makers: Sequence[VectorMaker], texts: dict[str, str], weightings: Sequence[Weights] = WEIGHTINGS,
            questions: Sequence[Question] = QUESTIONS) -> list[Retrieval]:
    """One row per way of making vectors and weighting."""
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for n, maker in enumerate(makers):
            database = Path(folder) / f"{n}.db"
            answers = _index(database, maker, texts, questions)
            vectors = [maker.query(q.question) for q in questions]
            index = SearchIndex(database)
            try:
                for weights in weightings:
                    ranks = [_ranks(index.search(maker.name, v, q.question, 1000, weights), *answers[q][:2])
                             for q, v in zip(questions, vectors, strict=True)]
                    rows.append(_row(maker, weights, ranks, answers, len(texts)))
            finally:
                index.close()
    return rows


Answers = tuple[set[int], set[int], int]  # (chunk ids whose sentences hold the anchor, job ids, all chunks)


def _index(database: Path, maker: VectorMaker, texts: dict[str, str],
           questions: Sequence[Question]) -> dict[Question, Answers]:
    """Index every text with `maker`'s vectors; which chunks and documents answer each question."""
    chunks: dict[int, tuple[int, str]] = {}  # chunk id -> (job id, its sentences, flattened)
    conn = sqlite.connect(database)
    try:
        conn.execute("BEGIN IMMEDIATE")
        for job_id, (name, text) in enumerate(sorted(texts.items()), 1):
            rows, spans = maker.document(text)
            write_entry(conn, IndexEntry(job_id, maker.name, f"/texts/{name}", name, "", rows[:-1], rows[-1],
                                         spans, text))
            sentences = sentence_spans(text)
            ids = [i for (i,) in conn.execute("SELECT id FROM search_chunks WHERE job_id = ? ORDER BY ordinal",
                                              (job_id,))]
            for chunk_id, (a, b) in zip(ids, spans.tolist(), strict=True):
                chunks[chunk_id] = (job_id, flat(text[slice(*widened_to_sentences(sentences, a, b))]))
        conn.execute("COMMIT")
    finally:
        conn.close()
    answers = {}
    for q in questions:
        holding = {i for i, (_, words) in chunks.items() if flat(q.anchor) in words}
        documents = {job_id for job_id, (_, text) in enumerate(sorted(texts.items()), 1)
                     if flat(q.anchor) in flat(text)}
        if flat(q.anchor) not in flat(texts[q.filename]) or not holding:
            raise ValueError(f"the anchor of {q.question!r} is not in {q.filename}'s text: {q.anchor!r}")
        answers[q] = (holding, documents, len(chunks))
    return answers


def _ranks(found: list[DocumentHits], chunks: set[int], documents: set[int]) -> tuple[float, float]:
    """(rank of the first answering passage, of the first answering document); inf when none is found. The
    search groups chunks by document: passages are ranked by their own scores, documents by their best."""
    passages = sorted((hit for hits in found for hit in hits.chunks), key=lambda hit: -hit.score)
    first = next((r for r, hit in enumerate(passages, 1) if hit.chunk_id in chunks), float("inf"))
    first_document = next((r for r, hits in enumerate(found, 1) if hits.document.job_id in documents), float("inf"))
    return first, first_document


def _row(maker: VectorMaker, weights: Weights, ranks: list[tuple[float, float]],
         answers: dict[Question, Answers], n_documents: int) -> Retrieval:
    passage, document = zip(*ranks, strict=True)
    chance_p = float(np.mean([len(c) / total for c, _, total in answers.values()]))
    chance_d = float(np.mean([len(d) / n_documents for _, d, _ in answers.values()]))
    return Retrieval(maker.pooling, weights, len(ranks), _recall(passage), _mrr(passage), _recall(document),
                     _mrr(document), round(chance_p, 3), round(chance_d, 3), maker.name, _recall(passage, 3),
                     _recall(document, 3))


def _recall(ranks: Sequence[float], at: int = 1) -> float:
    return round(sum(r <= at for r in ranks) / len(ranks), 3)


def _mrr(ranks: Sequence[float]) -> float:
    return round(float(np.mean([1 / r for r in ranks])), 3)
