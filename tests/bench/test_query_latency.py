"""The query-latency bench's checks before it times anything, and how it reads a search's output."""

from __future__ import annotations

import pytest

from npumoe.bench.service import query_latency


def test_a_home_with_nothing_processed_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no queue database"):
        query_latency.measure(tmp_path, runs=1)


def test_the_hits_are_each_documents_source_and_score_in_order():
    output = {"query": "q", "model_key": "m", "results": [{"source": "/a.txt", "score": 0.91, "passages": []},
                                                         {"source": "/b.md", "score": 0.5, "passages": []}]}
    assert query_latency.search_hits(output) == [("/a.txt", 0.91), ("/b.md", 0.5)]
