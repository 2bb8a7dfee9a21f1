"""DOCX to text: a streaming walk over the package's XML parts, in reading order.

A walk of our own rather than python-docx (which reads only a paragraph's direct runs) or mammoth (one more
dependency, built to convert to HTML, whose choice of what to read in each construct would not be ours): the
text a reader sees in Word is every w:t under the body, including tracked insertions (w:ins), content controls
(w:sdt), field results and text boxes (w:txbxContent), minus tracked deletions (w:del, w:moveFrom), field
instructions, the fallback copy of a drawing (mc:Fallback repeats the text box of mc:Choice) and the
placeholder a content control shows while empty. Footnotes and endnotes follow the body, as in print.
The standard library's iterparse keeps memory flat and has no recursion, whatever the nesting; expat resolves
no external entities and refuses runaway entity expansion.
"""

from __future__ import annotations

import io
import zipfile
from typing import IO
from xml.etree.ElementTree import iterparse

from ..errors import ExtractionError

# Body first, then the notes; a part the document does not have is skipped.
PARTS = ("word/document.xml", "word/footnotes.xml", "word/endnotes.xml")
# A DOCX part over a mebibyte that expands more than this looks like a zip bomb, not repetitive XML.
MAX_DOCX_RATIO = 200
RATIO_CHECK_BYTES = 2**20

# WordprocessingML in its transitional (what Word writes) and strict namespaces.
_W = (
    "http://schemas.openxmlformats.org/wordprocessingml/2006/main",
    "http://purl.oclc.org/ooxml/wordprocessingml/main",
)
_MC = "http://schemas.openxmlformats.org/markup-compatibility/2006"
# Elements whose whole subtree is not text a reader sees.
_SKIPPED = frozenset({"del", "moveFrom", "instrText", "delInstrText", "sdtPr"})
_CHARACTERS = {"tab": "\t", "br": "\n", "cr": "\n", "noBreakHyphen": "-"}


def docx_text(data: bytes, max_bytes: int) -> str:
    """The document's text: one block per paragraph, a table row as its cells joined by " | "."""
    archive = zipfile.ZipFile(io.BytesIO(data))
    _refuse_zip_bomb(archive, max_bytes)
    names = set(archive.namelist())
    blocks: list[str] = []
    for part in PARTS:
        if part in names:
            with archive.open(part) as stream:
                blocks += _part_blocks(stream)
    return "\n\n".join(block for block in blocks if block.strip())


def _part_blocks(stream: IO[bytes]) -> list[str]:
    """The blocks of one WordprocessingML part, from start/end events (no tree is kept)."""
    blocks: list[str] = []
    sinks = [blocks]  # where a finished paragraph goes: the part, or the table cell being read
    paragraphs: list[list[str]] = []  # open paragraphs: a text box's paragraphs open inside another
    placeholders: list[bool] = []  # per open content control: is it showing its placeholder?
    skipping = 0  # depth inside a subtree that is not read
    for event, element in iterparse(stream, events=("start", "end")):
        namespace, _, name = element.tag[1:].partition("}")
        ours = namespace in _W
        if event == "start":
            if ours and name == "showingPlcHdr" and skipping == 1 and placeholders:  # in the skipped w:sdtPr
                placeholders[-1] = True
            if skipping or _starts_skip(namespace, name, placeholders):
                skipping += 1
            elif ours and name == "p":
                paragraphs.append([])
            elif ours and name in ("tr", "tc"):
                sinks.append([])
            elif ours and name == "sdt":
                placeholders.append(False)
            continue
        if skipping:
            skipping -= 1
        elif not ours:
            pass
        elif name == "t" and paragraphs:
            paragraphs[-1].append(element.text or "")
        elif name in _CHARACTERS and paragraphs:
            paragraphs[-1].append(_CHARACTERS[name])
        elif name == "p":
            sinks[-1].append("".join(paragraphs.pop()))
        elif name == "tc":
            cell = sinks.pop()
            sinks[-1].append(" ".join(block.strip() for block in cell if block.strip()))
        elif name == "tr":
            cells = sinks.pop()
            if any(cells):
                sinks[-1].append(" | ".join(cells))
        elif name == "sdt":
            placeholders.pop()
        element.clear()  # read: free it, so a long document never sits in memory as a tree
    return blocks


def _starts_skip(namespace: str, name: str, placeholders: list[bool]) -> bool:
    if namespace == _MC:
        return name == "Fallback"
    if namespace not in _W:
        return False
    return name in _SKIPPED or (name == "sdtContent" and bool(placeholders) and placeholders[-1])


def _refuse_zip_bomb(archive: zipfile.ZipFile, max_bytes: int) -> None:
    """Judge a ZIP by the sizes it declares, before inflating anything (zipfile never inflates past them)."""
    members = archive.infolist()
    total = sum(member.file_size for member in members)
    if total > max_bytes:
        raise ExtractionError("too_large", f"DOCX unpacks to {total:,} bytes, over the {max_bytes:,} limit")
    for member in members:
        ratio = member.file_size / max(member.compress_size, 1)
        if member.file_size > RATIO_CHECK_BYTES and ratio > MAX_DOCX_RATIO:
            message = f"DOCX part {member.filename} expands {ratio:,.0f}-fold (zip bomb)"
            raise ExtractionError("too_large", message)
