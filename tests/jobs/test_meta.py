"""meta.json read back: one reader, one set of checks, for every caller."""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

import pytest
from support.sample_meta import document_meta

from npumoe.jobs.meta import read_meta
from npumoe.jobs.outputs import META_FILE
from npumoe.jobs.search.index import IndexEntry, OutputsUnreadable


def write(folder: Path, meta: object) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / META_FILE).write_text(json.dumps(meta))
    return folder


def test_a_written_meta_json_reads_back_as_written(tmp_path: Path) -> None:
    meta = document_meta(job_id=7, source="/in/report.pdf")
    tmp_path.joinpath(META_FILE).write_bytes(meta.to_json())
    assert read_meta(tmp_path) == asdict(meta)


@pytest.mark.parametrize(("change", "reason"), [
    ({"schema_version": 2}, "meta.json schema 2, expected 1"),
    ({"job_id": "7"}, "meta.json lacks a valid 'job_id'"),
    ({"job_id": True}, "meta.json lacks a valid 'job_id'"),
    ({"model_key": None}, "meta.json lacks a valid 'model_key'"),
    ({"sha256": "abc"}, "meta.json's 'sha256' is not a SHA-256 in hex"),
    ({"created_at": "yesterday"}, "meta.json's 'created_at' is not ISO 8601"),
])
def test_a_meta_json_out_of_schema_is_refused_saying_what_is_wrong(tmp_path: Path, change: dict[str, object],
                                                                   reason: str) -> None:
    with pytest.raises(ValueError, match=re.escape(reason)):
        read_meta(write(tmp_path, asdict(document_meta()) | change))


def test_a_missing_or_broken_meta_json_is_refused_like_one_out_of_schema(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=re.escape("cannot read meta.json")):
        read_meta(tmp_path)
    (tmp_path / META_FILE).write_text("{not json")
    with pytest.raises(ValueError, match=re.escape("meta.json is not JSON")):
        read_meta(tmp_path)


def test_the_search_index_refuses_an_output_for_the_readers_reason(tmp_path: Path) -> None:
    folder = write(tmp_path / "out", {k: v for k, v in asdict(document_meta()).items() if k != "model_key"})
    with pytest.raises(OutputsUnreadable, match=re.escape(f"{folder}: meta.json lacks a valid 'model_key'")):
        IndexEntry.read(folder)
