"""Extraction: every format reads back, every hostile input ends in a classified error within its limits."""

from __future__ import annotations

import json
import signal
import sys
import textwrap
import tracemalloc
import zipfile
from pathlib import Path

import psutil
import pytest
from extraction import LIMITS, extraction_error, words
from pypdf import PdfReader
from support import hostile_files
from support.pdf_writer import pdf_bytes

from npumoe.daemon.samples import SampleDocument, sample_documents, write_samples
from npumoe.jobs.errors import ExtractionError
from npumoe.jobs.extract import isolated
from npumoe.jobs.extract.isolated import ExtractLimits, child_failure, detect_format, extract_text

FORMAT_OF_SUFFIX = {".txt": "text", ".md": "markdown", ".html": "html", ".pdf": "pdf", ".docx": "docx"}


@pytest.fixture(scope="module")
def samples(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {path.name: path for path in write_samples(tmp_path_factory.mktemp("samples"))}


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return hostile_files.make_all(
        tmp_path_factory.mktemp("hostile"), bomb_bytes=96 * 2**20, huge_bytes=LIMITS.max_bytes + 1
    )


@pytest.mark.parametrize("document", sample_documents(), ids=lambda document: document.filename)
def test_every_sample_format_reads_back_all_its_paragraphs(samples: dict[str, Path], document: SampleDocument) -> None:
    result = extract_text(samples[document.filename], LIMITS)

    assert result.format == FORMAT_OF_SUFFIX[Path(document.filename).suffix]
    for paragraph in document.paragraphs:
        assert words(paragraph) in words(result.text)


@pytest.mark.parametrize("name", ["field-note.txt", "waiting-well.md", "battery-budget.html", "expert-committee.docx"])
def test_paragraphs_stay_apart_where_the_format_marks_them(samples: dict[str, Path], name: str) -> None:
    document = next(document for document in sample_documents() if document.filename == name)

    blocks = extract_text(samples[name], LIMITS).text.split("\n\n")

    assert set(document.paragraphs) <= set(blocks)


def test_pdf_reports_its_page_count_and_other_formats_none(samples: dict[str, Path]) -> None:
    pdf = samples["paper-archive.pdf"]

    assert extract_text(pdf, LIMITS).pages == len(PdfReader(pdf).pages) > 1
    assert extract_text(samples["expert-committee.docx"], LIMITS).pages is None
    assert extract_text(samples["field-note.txt"], LIMITS).pages is None


def test_html_yields_visible_text_only(samples: dict[str, Path]) -> None:
    text = extract_text(samples["battery-budget.html"], LIMITS).text

    assert "Power & patience" in text
    assert "scripts are not text" not in text
    assert "font-family" not in text
    assert "<" not in text


def test_docx_tables_are_read_row_by_row(samples: dict[str, Path]) -> None:
    text = extract_text(samples["expert-committee.docx"], LIMITS).text

    assert "Group | Tier | Runs on" in text.splitlines()


@pytest.mark.parametrize(
    ("source", "disguise"),
    [
        ("paper-archive.pdf", "archive.txt"),
        ("expert-committee.docx", "committee.pdf"),
        ("battery-budget.html", "battery.txt"),
        ("field-note.txt", "note.docx"),
    ],
)
def test_format_is_recognised_by_content_not_extension(
    samples: dict[str, Path], tmp_path: Path, source: str, disguise: str
) -> None:
    disguised = tmp_path / disguise
    disguised.write_bytes(samples[source].read_bytes())

    assert detect_format(disguised) == FORMAT_OF_SUFFIX[Path(source).suffix]
    assert extract_text(disguised, LIMITS).text == extract_text(samples[source], LIMITS).text


def test_extension_only_breaks_the_tie_between_text_and_markdown(tmp_path: Path) -> None:
    (tmp_path / "plain.txt").write_text("Just a line.\n")
    (tmp_path / "plain.md").write_text("Just a line.\n")
    (tmp_path / "headed.txt").write_text("# A heading\n\nJust a line.\n")

    assert detect_format(tmp_path / "plain.txt") == "text"
    assert detect_format(tmp_path / "plain.md") == "markdown"
    assert detect_format(tmp_path / "headed.txt") == "markdown"


def test_an_html_page_is_recognised_behind_an_xml_declaration_and_comments(tmp_path: Path) -> None:
    page = tmp_path / "page.txt"
    page.write_text('<?xml version="1.0"?>\n<!-- saved by a browser -->\n<html><body><p>Hello.</p></body></html>')

    assert detect_format(page) == "html"
    assert extract_text(page, LIMITS).text == "Hello."


@pytest.mark.parametrize("case", sorted(hostile_files.EXPECTED))
def test_hostile_input_ends_with_its_expected_outcome(hostile: dict[str, Path], case: str) -> None:
    path = hostile[case]
    if case == "unreadable_file" and not hostile_files.permissions_enforced(path):
        pytest.skip("this process reads mode-000 files (root): the permission check cannot be exercised")
    expected = hostile_files.EXPECTED[case]

    if expected is None:
        assert hostile_files.SENTENCE in extract_text(path, LIMITS).text
    else:
        error = extraction_error(path)
        assert error.kind == expected
        assert str(error) and "\n" not in str(error)


def test_invalid_utf8_falls_back_to_the_windows_code_page(hostile: dict[str, Path]) -> None:
    assert "café: “" in extract_text(hostile["invalid_utf8"], LIMITS).text


@pytest.mark.parametrize(("codec", "bom"), [("utf-8-sig", "UTF-8"), ("utf-16", "UTF-16"), ("utf-32", "UTF-32")])
def test_text_with_a_byte_order_mark_decodes_by_it(tmp_path: Path, codec: str, bom: str) -> None:
    path = tmp_path / "bom.txt"
    path.write_bytes(f"{bom} text: naïve café".encode(codec))

    assert extract_text(path, LIMITS).text == f"{bom} text: naïve café"


def test_a_zip_bomb_under_the_size_limit_is_refused_by_its_expansion_ratio(tmp_path: Path) -> None:
    bomb = hostile_files.zip_bomb_docx(tmp_path, expanded_bytes=4 * 2**20)

    error = extraction_error(bomb)

    assert error.kind == "too_large"
    assert "zip bomb" in str(error)


@pytest.mark.parametrize("name", ["night-shift-log.txt", "paper-archive.pdf"])
def test_text_over_max_chars_is_too_large_never_truncated(samples: dict[str, Path], name: str) -> None:
    error = extraction_error(samples[name], ExtractLimits(max_chars=1_000))

    assert error.kind == "too_large"


def test_a_pdf_without_text_is_empty(tmp_path: Path) -> None:
    blank = tmp_path / "blank.pdf"
    blank.write_bytes(pdf_bytes([b"q Q"]))  # a page that draws nothing: no text, and no image to call it a scan

    assert extraction_error(blank).kind == "empty"


def test_a_zip_that_is_not_a_word_document_is_unsupported(tmp_path: Path) -> None:

    with zipfile.ZipFile(tmp_path / "sheet.docx", "w") as archive:
        archive.writestr("xl/workbook.xml", "<workbook/>")

    assert extraction_error(tmp_path / "sheet.docx").kind == "unsupported"


def test_a_parse_over_the_time_limit_is_killed_and_leaves_no_child(tmp_path: Path) -> None:
    slow = hostile_files.deeply_nested_html(tmp_path, depth=400_000)  # seconds of parsing
    children_before = set(psutil.Process().children())

    error = extraction_error(slow, ExtractLimits(timeout_s=0.3))

    assert error.kind == "timeout"
    assert set(psutil.Process().children()) <= children_before


@pytest.mark.skipif(sys.platform != "linux", reason="only Linux enforces RLIMIT_AS")
def test_a_parse_over_the_memory_limit_is_classified_as_memory(tmp_path: Path) -> None:
    big = tmp_path / "big.txt"
    big.write_bytes(b"plenty of words " * (3 * 2**20))  # 48 MiB read, then decoded: past a 64 MiB cap

    error = extraction_error(big, ExtractLimits(memory_mb=64))

    assert error.kind == "memory"


def test_a_crashed_child_is_classified_by_how_it_died() -> None:
    assert child_failure(-signal.SIGKILL, b"").kind == "memory"
    assert child_failure(1, b"Traceback (most recent call last):\nMemoryError\n").kind == "memory"
    crash = child_failure(-signal.SIGSEGV, b"")
    assert crash.kind == "corrupt"
    assert "SIGSEGV" in str(crash)


def test_detect_format_refuses_what_it_cannot_read(hostile: dict[str, Path]) -> None:
    with pytest.raises(ExtractionError) as caught:
        detect_format(hostile["binary_with_text_extension"])
    assert caught.value.kind == "unsupported"
    with pytest.raises(ExtractionError) as caught:
        detect_format(hostile["fifo"])
    assert caught.value.kind == "unreadable"


def test_extraction_error_names_only_known_kinds() -> None:
    with pytest.raises(ValueError, match="unknown extraction error kind"):
        ExtractionError("mysterious", "something happened")
    assert str(ExtractionError("corrupt", "two\nlines")) == "two lines"


@pytest.mark.parametrize("field", ["timeout_s", "memory_mb", "max_bytes", "max_chars"])
def test_limits_must_be_positive(field: str) -> None:
    with pytest.raises(ValueError, match=f"ExtractLimits.{field} must be positive"):
        ExtractLimits(**{field: 0})


def test_the_child_never_imports_modules_from_the_working_directory(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "inbox"
    folder.mkdir()
    (folder / "json.py").write_text("raise SystemExit('the json.py of the working directory ran')\n")
    (folder / "note.txt").write_text("Plain words.\n")
    monkeypatch.chdir(folder)  # `npumoed run --once --inbox .` in a folder that holds a json.py
    monkeypatch.setenv("PYTHONPATH", str(folder))

    assert extract_text(folder / "note.txt", LIMITS).text == "Plain words."


REPLY = json.dumps({"text": "Plain words.", "format": "text", "pages": None})


def stand_in_child(monkeypatch: pytest.MonkeyPatch, code: str) -> None:
    """Extraction runs `code` as its child instead of the parser: what the parent does about it is under test."""
    monkeypatch.setattr(isolated, "CHILD_COMMAND", [sys.executable, "-I", "-c", textwrap.dedent(code)])


def note(tmp_path: Path) -> Path:
    (tmp_path / "note.txt").write_text("Plain words.\n")
    return tmp_path / "note.txt"


def test_a_child_over_the_memory_limit_is_stopped_where_the_address_space_cap_is_not_enforced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stand_in_child(monkeypatch, """
        import time
        held = bytearray(256 * 2**20)  # resident, as macOS lets a parser grow: nothing caps its address space
        time.sleep(60)
    """)
    error = extraction_error(note(tmp_path), ExtractLimits(timeout_s=30, memory_mb=64))

    assert error.kind == "memory"
    assert str(error).startswith("extraction used more than 64 MiB of memory and was stopped")


def test_a_child_that_writes_endless_warnings_costs_only_the_tail_of_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stand_in_child(monkeypatch, """
        import sys
        for _ in range(32 * 1024):
            sys.stderr.write("warning: duplicate key in the PDF's dictionary, the last one is kept\\n" * 8)
        sys.exit("the parser gave up")
    """)
    tracemalloc.start()
    try:
        error = extraction_error(note(tmp_path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert error.kind == "corrupt" and str(error).endswith("exit status 1: the parser gave up)")
    assert peak < 4 * 2**20  # of the 18 MiB written


def test_the_time_limit_counts_the_processor_time_the_child_uses_not_the_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stand_in_child(monkeypatch, f"""
        import sys, time
        time.sleep(1.5)  # the time a child waits for a busy machine is not time spent parsing
        sys.stdout.write({REPLY!r})
    """)
    assert extract_text(note(tmp_path), ExtractLimits(timeout_s=0.5)).text == "Plain words."


def test_a_child_that_waits_for_ever_is_stopped_all_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in_child(monkeypatch, """
        import time
        time.sleep(600)
    """)
    error = extraction_error(note(tmp_path), ExtractLimits(timeout_s=0.1))

    assert error.kind == "timeout"
    assert str(error) == "extraction waited 1 s without running and was stopped"
