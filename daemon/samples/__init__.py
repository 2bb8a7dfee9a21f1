"""Sample documents shipped with the daemon, for `make demo`, the fidelity benchmark and the tests.

Six documents in five formats and three lengths (original prose about the very work the daemon does): a short
note, a Markdown essay that needs several prefill chunks, an HTML page, a PDF, a DOCX, and a log longer than a
small demo model's whole context. They are package data, copied byte for byte, so every run sees the same files.
"""

from __future__ import annotations

import html
import io
import re
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path, PurePath

# In the order the demo places them in the inbox.
FILENAMES = (
    "field-note.txt",
    "waiting-well.md",
    "battery-budget.html",
    "paper-archive.pdf",
    "expert-committee.docx",
    "night-shift-log.txt",
)


@dataclass(frozen=True)
class SampleDocument:
    filename: str
    paragraphs: tuple[str, ...]  # the body text, without title, headings, lists or tables


def sample_documents() -> list[SampleDocument]:
    """Every sample's paragraphs, read from the shipped file: the text its extraction must give back."""
    return [SampleDocument(name, _paragraphs(name, _data(name))) for name in FILENAMES]


def write_samples(directory: Path) -> list[Path]:
    """Write every sample document into `directory` (created if missing); returns their paths in order."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in FILENAMES:
        path = directory / name
        path.write_bytes(_data(name))
        paths.append(path)
    return paths


def _data(name: str) -> bytes:
    return files(__name__).joinpath(name).read_bytes()


def _paragraphs(name: str, data: bytes) -> tuple[str, ...]:
    """The file's text blocks that are prose: in these samples every paragraph, and no title, heading, list
    item or table cell, ends with a full stop."""
    return tuple(block for block in _blocks(PurePath(name).suffix, data) if block.endswith("."))


def _blocks(suffix: str, data: bytes) -> list[str]:
    """The file's text in blocks, read straight from the format (not through the extraction under test)."""
    if suffix in (".txt", ".md"):
        return [block.strip() for block in data.decode().split("\n\n")]
    if suffix == ".html":
        return [html.unescape(text) for text in re.findall(r"<p>(.*?)</p>", data.decode())]
    if suffix == ".docx":
        import docx

        return [paragraph.text for paragraph in docx.Document(io.BytesIO(data)).paragraphs]
    if suffix == ".pdf":
        return _pdf_blocks(data)
    raise ValueError(f"no reader for {suffix!r} samples")


def _pdf_blocks(data: bytes) -> list[str]:
    """The sample PDF shows one wrapped line per `(text) Tj T*` and an empty line between paragraphs."""
    from pypdf import PdfReader

    lines = []
    for page in PdfReader(io.BytesIO(data)).pages:
        shown = re.findall(rb"^\((.*)\) Tj T\*$", page.get_contents().get_data(), re.MULTILINE)
        lines += [re.sub(rb"\\(.)", rb"\1", line).decode("cp1252") for line in shown]
    return [block.replace("\n", " ") for block in "\n".join(lines).strip().split("\n\n")]
