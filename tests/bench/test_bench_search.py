"""`npumoed bench search`: an index of random vectors, filled through the daemon's write path and queried."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from npumoe.bench.cli import bench
from npumoe.bench.service.search import MODEL_KEY, fill
from npumoe.jobs.search.index import SearchIndex


def test_fill_indexes_every_document_and_a_search_returns_k_chunks(tmp_path: Path) -> None:
    database = tmp_path / "index.db"
    fill(database, documents=12, chunks=3, dim=16, seed=0)
    index = SearchIndex(database)
    try:
        assert index.models() == {MODEL_KEY: 12}
        hits = index.search(MODEL_KEY, [1.0] + [0.0] * 15, "", 5)
        assert sum(len(h.chunks) for h in hits) == 5
        assert [c.score for h in hits for c in h.chunks] == sorted((c.score for h in hits for c in h.chunks),
                                                                   reverse=True)
    finally:
        index.close()


def test_bench_search_prints_a_table_and_writes_latencies_per_width(tmp_path: Path) -> None:
    out = tmp_path / "search.json"
    result = CliRunner().invoke(bench, ["search", "--documents", "20", "--chunks", "3", "--dim", "16", "--dim", "32",
                                        "--queries", "3", "-k", "4", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "search: 20 documents × 3 chunks, 3 queries" in result.output
    rows = json.loads(out.read_text())["results"]
    assert [(r["dim"], r["documents"], r["chunks_per_document"], r["k"]) for r in rows] == [(16, 20, 3, 4),
                                                                                            (32, 20, 3, 4)]
    assert all(0 < r["median_ms"] <= r["p95_ms"] for r in rows)
