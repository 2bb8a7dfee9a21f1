"""Search latency at archive scale: an index of random vectors, queried the way `npumoed search` queries it.

The index is filled through the same write path the daemon uses (`write_entry`), vectors only (no text,
so no words to match); a query is `SearchIndex.search` with a random unit vector: the k-nearest-chunk
scan of sqlite-vec (exact, brute force), then the grouping by document. Embedding the query with the
model is not part of it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from npumoe.jobs.queue import sqlite
from npumoe.jobs.search.index import IndexEntry, SearchIndex, write_entry

MODEL_KEY = "bench@random"


@dataclass(frozen=True)
class SearchLatency:
    dim: int
    documents: int
    chunks_per_document: int
    k: int
    queries: int
    fill_seconds: float
    database_mb: float
    median_ms: float
    p95_ms: float


def fill(database: Path, *, documents: int, chunks: int, dim: int, seed: int) -> float:
    """Index `documents` × `chunks` random unit vectors (plus one per document) in one transaction; seconds."""
    rng = np.random.default_rng(seed)
    conn = sqlite.connect(database)
    started = time.perf_counter()
    try:
        conn.execute("BEGIN IMMEDIATE")
        for job_id in range(1, documents + 1):
            rows = _unit(rng.standard_normal((chunks + 1, dim), dtype=np.float32))
            write_entry(conn, IndexEntry(job_id, MODEL_KEY, f"/outbox/doc-{job_id}", f"/inbox/doc-{job_id}.txt",
                                         "", rows[:-1], rows[-1], None, None))
        conn.execute("COMMIT")
    finally:
        conn.close()
    return time.perf_counter() - started


def query_latency(database: Path, *, dim: int, k: int, queries: int, seed: int) -> list[float]:
    """Seconds of each of `queries` searches for a random vector, after one untimed search."""
    rng = np.random.default_rng(seed + 1)
    index = SearchIndex(database)
    try:
        index.search(MODEL_KEY, _unit(rng.standard_normal(dim, dtype=np.float32)), "", k)
        seconds = []
        for _ in range(queries):
            vector = _unit(rng.standard_normal(dim, dtype=np.float32))
            started = time.perf_counter()
            index.search(MODEL_KEY, vector, "", k)
            seconds.append(time.perf_counter() - started)
    finally:
        index.close()
    return seconds


def run_search_benchmark(folder: Path, *, dim: int, documents: int, chunks: int, k: int, queries: int,
                         seed: int = 0) -> SearchLatency:
    database = folder / f"search-{dim}.db"
    fill_s = fill(database, documents=documents, chunks=chunks, dim=dim, seed=seed)
    seconds = query_latency(database, dim=dim, k=k, queries=queries, seed=seed)
    size = sum(p.stat().st_size for p in folder.glob(f"{database.name}*")) / 2**20
    median, p95 = statistics.median(seconds), float(np.percentile(seconds, 95))
    return SearchLatency(dim, documents, chunks, k, queries, round(fill_s, 2), round(size, 1),
                         round(1000 * median, 2), round(1000 * p95, 2))


def _unit(rows: np.ndarray) -> np.ndarray:
    return rows / np.linalg.norm(rows, axis=-1, keepdims=True)
