"""summary.md: what `render_summary` writes, `parse_summary` reads back, block for block."""

from __future__ import annotations

import os
from pathlib import Path

from npumoe.jobs.outputs import SUMMARY_FILE
from npumoe.jobs.summary_file import SummaryFile, parse_summary, read_summary, render_summary


def test_a_rendered_summary_parses_back_to_its_name_facts_and_text() -> None:
    markdown = render_summary("notes.md", "demo", 3, 30, "  First line.\n\nA second paragraph.\n")
    assert parse_summary(markdown) == SummaryFile(
        "notes.md", ("model `demo`", "3 chunks", "30 tokens"), "First line.\n\nA second paragraph.")
    assert markdown.startswith("# notes.md\n\n")


def test_a_name_or_model_with_newlines_cannot_move_the_blocks() -> None:
    markdown = render_summary("two\n\nlines.txt", "a\n\nmodel", 1, 8, "The summary.")
    parsed = parse_summary(markdown)
    assert (parsed.title, parsed.facts[0], parsed.text) == ("two lines.txt", "model `a model`", "The summary.")


def test_a_name_that_is_not_utf8_is_shown_by_its_bytes() -> None:
    name = os.fsdecode(b"r\xe9sum\xe9.txt")
    markdown = render_summary(name, "demo", 1, 8, "The summary.")
    assert parse_summary(markdown).title == "r\\xe9sum\\xe9.txt"
    markdown.encode()  # writable as UTF-8


def test_the_first_line_is_the_summarys_own_not_the_heading() -> None:
    assert parse_summary(render_summary("n.md", "demo", 1, 8, "\nHeadline.\nDetail.")).first_line == "Headline."


def test_a_file_cut_short_reads_with_its_missing_blocks_empty() -> None:
    assert parse_summary("# report.pdf\n") == SummaryFile("report.pdf", (), "")
    assert parse_summary("").first_line == ""


def test_an_output_folders_summary_is_read_from_its_file(tmp_path: Path) -> None:
    (tmp_path / SUMMARY_FILE).write_text(render_summary("a.txt", "demo", 2, 20, "Short."))
    assert read_summary(tmp_path).text == "Short."
