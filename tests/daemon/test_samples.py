"""Sample documents: written in five formats, recognised by content, one of them longer than a demo context."""

from __future__ import annotations

import io
import re
import time
from pathlib import Path

import pytest
from pypdf import PdfReader
from support.pdf_writer import text_pdf

from npumoe.daemon.samples import sample_documents, write_samples
from npumoe.jobs.extract.isolated import FORMATS, detect_format, extract_text


def test_every_sample_is_written_in_order_into_a_new_directory(tmp_path: Path) -> None:
    directory = tmp_path / "not" / "yet" / "there"

    paths = write_samples(directory)

    assert [path.name for path in paths] == [document.filename for document in sample_documents()]
    assert all(path.parent == directory and path.stat().st_size > 0 for path in paths)


def test_samples_cover_every_format_as_recognised_by_content(tmp_path: Path) -> None:
    assert {detect_format(path) for path in write_samples(tmp_path)} == set(FORMATS)


def test_one_sample_is_longer_than_a_demo_models_context(tmp_path: Path) -> None:
    longest = max((extract_text(path) for path in write_samples(tmp_path)), key=lambda result: len(result.text))

    # 60,000 characters are over 10,000 tokens even for a tokenizer averaging 6 characters a token.
    assert len(longest.text) >= 60_000


def test_the_markdown_essay_runs_to_several_thousand_words(tmp_path: Path) -> None:
    essay = next(path for path in write_samples(tmp_path) if path.suffix == ".md")

    assert len(essay.read_text().split()) >= 2_500


def test_samples_are_byte_identical_on_every_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = write_samples(tmp_path / "first")
    monkeypatch.setattr(time, "time", lambda: 2_000_000_000.0)  # a later clock: the DOCX's ZIP must not record it
    second = write_samples(tmp_path / "second")

    for one, other in zip(first, second, strict=True):
        assert one.read_bytes() == other.read_bytes(), one.name


def test_every_sample_has_paragraphs_to_check_its_extraction_against() -> None:
    assert all(document.paragraphs for document in sample_documents())


def test_no_sentence_repeats_within_a_paragraph() -> None:
    for document in sample_documents():
        for paragraph in document.paragraphs:
            sentences = re.split(r"(?<=\.) ", paragraph)
            assert len(sentences) == len(set(sentences)), paragraph


def test_written_pdf_has_an_exact_cross_reference_table() -> None:
    data = text_pdf(["A first paragraph.", "A second (parenthesised) one, with a backslash \\ too."])

    xref_at = int(data.rsplit(b"startxref\n", 1)[1].split(b"\n", 1)[0])
    entries = re.findall(rb"(\d{10}) 00000 n \n", data[xref_at:])
    assert data[xref_at:].startswith(b"xref\n")
    assert entries
    for number, offset in enumerate(entries, start=1):
        assert data[int(offset) :].startswith(b"%d 0 obj\n" % number)
    page_text = PdfReader(io.BytesIO(data), strict=True).pages[0].extract_text()
    assert "A second (parenthesised) one, with a backslash \\ too." in page_text
