"""`meta.json`: what a document's outputs are, how they were made and what making them cost.

Written once, from `DocumentMeta`; every figure has one place in it. docs/outputs.md lists each field and tests
check a produced file against that list, so change both together, and raise SCHEMA_VERSION when a field is
renamed, removed or changes type or meaning.

Read back by one function, `read_meta`, for every caller (a later attempt finding its finished output, the search
index, rebuilding the queue, the batch report), with one set of checks.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from npumoe.engine.vocabulary import MEAN

from .outputs import META_FILE

SCHEMA_VERSION = 1
SHA256 = re.compile(r"^[0-9a-f]{64}$")
# The fields read back from a written meta.json, and their types. The rest are checked only when written: outputs
# made before a field was added (within this schema version) stay readable.
READ_BACK: dict[str, type | tuple[type, ...]] = {
    "source": str, "sha256": str, "job_id": int, "model": str, "model_key": str, "plan": (str, type(None)),
    "backend": str, "overflow": str, "dtype": str, "chunk_tokens": int, "created_at": str,
}


@dataclass(frozen=True)
class Extraction:
    format: str  # one of the extractor's FORMATS
    pages: int | None  # None for formats without pages
    chars: int  # characters of extracted text handed to the engine


@dataclass(frozen=True)
class Embeddings:
    dim: int  # the width of each row; there is one row per chunk, plus the document vector
    pooling: str = MEAN  # how the rows were pooled from the prefill (vocabulary.POOLINGS)


@dataclass(frozen=True)
class Seconds:
    """Wall seconds. The engine's phases fall inside `engine`; `total` also holds extraction and model loading."""

    extract: float
    prefill: float
    summary: float
    reduce: float
    engine: float
    total: float


@dataclass(frozen=True)
class Residency:
    """Where the plan's groups ran: decided at load for the backend and machine at hand."""

    accelerator_groups: int
    cpu_groups: int
    measured_on: str | None  # the backend and machine whose measured costs decided it; None without them
    fallback: str | None  # why the backend's graphs ran through torch instead of its device; None when they did not


@dataclass(frozen=True, kw_only=True)
class DocumentMeta:
    schema_version: int = SCHEMA_VERSION
    source: str  # the document's path when it was queued
    sha256: str
    job_id: int
    model: str  # as configured: "demo", a folder or a Hugging Face id
    model_key: str  # the model actually loaded, revision included
    plan: str | None
    backend: str
    overflow: str
    weights: str  # the format the engine ran: fp32, bf16, int8 or int4 (auto decided at load)
    dtype: str  # the float dtype beside it: int8 and int4 keep the rest of the model in bfloat16
    chunk_tokens: int  # the prefill chunk length used: the plan's, the configured one, or the one measured here
    residency: Residency
    extraction: Extraction
    tokens: int
    chunks: int
    sections: int
    reduce_rounds: int
    generated_tokens: int  # summary and combine tokens the model wrote, thinking removed from summary.md included
    embeddings: Embeddings
    seconds: Seconds
    # The daemon's process (all threads) and its reaped children, e.g. the extractor, over `seconds.total`.
    cpu_seconds: float
    energy_joules: float | None  # over `seconds.total`; None where the platform does not measure it
    energy_source: str
    dispatch: dict[str, int | float]  # DispatchStats.to_dict(): the prefill's MoE dispatch counts and fractions
    npumoed_version: str
    created_at: str  # ISO 8601, UTC

    def to_json(self) -> bytes:
        return (json.dumps(asdict(self), indent=2, ensure_ascii=False) + "\n").encode()


def read_meta(folder: Path) -> dict[str, Any]:
    """The meta.json of the output folder `folder`, checked: of this schema version, with each READ_BACK field
    of its type, a SHA-256 in hex and an ISO 8601 creation time. ValueError says what is wrong with it."""
    try:
        meta = json.loads((folder / META_FILE).read_bytes())
    except OSError as e:
        raise ValueError(f"cannot read {META_FILE} ({e.strerror})") from e
    except ValueError as e:
        raise ValueError(f"{META_FILE} is not JSON ({e})") from e
    if not isinstance(meta, dict) or meta.get("schema_version") != SCHEMA_VERSION:
        version = meta.get("schema_version") if isinstance(meta, dict) else None
        raise ValueError(f"{META_FILE} schema {version!r}, expected {SCHEMA_VERSION}")
    for name, kind in READ_BACK.items():
        if not isinstance(meta.get(name), kind) or isinstance(meta.get(name), bool):
            raise ValueError(f"{META_FILE} lacks a valid '{name}'")
    if not SHA256.match(meta["sha256"]):
        raise ValueError(f"{META_FILE}'s 'sha256' is not a SHA-256 in hex")
    try:
        datetime.fromisoformat(meta["created_at"])
    except ValueError as e:
        raise ValueError(f"{META_FILE}'s 'created_at' is not ISO 8601 ({e})") from e
    return meta
