"""DOCX as Word writes it: tracked changes, content controls, fields, text boxes and notes all read right."""

from __future__ import annotations

import pytest
from extraction import LIMITS
from support.docx_writer import HIDDEN, REVISED, revised_docx

from npumoe.jobs.extract.isolated import extract_text


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("docx") / "minutes.docx"
    path.write_bytes(revised_docx())
    return extract_text(path, LIMITS).text


@pytest.mark.parametrize("what", sorted(REVISED))
def test_every_text_a_reader_sees_is_extracted(text: str, what: str) -> None:
    assert text.count(REVISED[what]) == 1  # once: a text box's fallback copy is not read twice


@pytest.mark.parametrize("what", sorted(HIDDEN))
def test_text_a_reader_does_not_see_is_left_out(text: str, what: str) -> None:
    assert HIDDEN[what] not in text


def test_a_tracked_insertion_joins_its_sentence_and_notes_follow_the_body(text: str) -> None:
    blocks = text.split("\n\n")

    assert blocks[0] == f"{REVISED['kept']} {REVISED['inserted']}."
    assert blocks[-2:] == [REVISED["footnote"], REVISED["endnote"]]
