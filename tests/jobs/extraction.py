"""What the extraction tests share: one set of limits that every sample document fits in, and the error a document
that yields no text ends in."""

from __future__ import annotations

from pathlib import Path

import pytest

from npumoe.jobs.errors import ExtractionError
from npumoe.jobs.extract.isolated import ExtractLimits, extract_text

LIMITS = ExtractLimits(timeout_s=30, memory_mb=512, max_bytes=8 * 2**20, max_chars=1_000_000)


def words(text: str) -> str:
    """`text` with every run of whitespace one space: what a reader sees, whatever the line breaks."""
    return " ".join(text.split())


def extraction_error(path: Path, limits: ExtractLimits = LIMITS) -> ExtractionError:
    with pytest.raises(ExtractionError) as caught:
        extract_text(path, limits)
    return caught.value
