"""Document formats: recognise one by its content and turn its bytes into plain text.

This module runs inside the extraction child process, so at the top it imports only the standard library
and the jobs layer's parser modules, which import their libraries (pypdf, trafilatura, charset-normalizer)
only when they parse. A library that will not import is the machine's fault: MissingDependency, never a
corrupt document.
"""

from __future__ import annotations

import io
import re
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import BinaryIO

from ..errors import ExtractionError, MissingDependency
from .decode import bom_codec, decode_text
from .docx import docx_text
from .html import html_text
from .pdf import pdf_text

FORMATS = ("text", "markdown", "html", "pdf", "docx")

SNIFF_BYTES = 8192
MAX_CONTROL_RATIO = 0.05  # text has tabs and newlines, almost never other control bytes
MARKDOWN_SUFFIXES = frozenset({".md", ".markdown", ".mdown", ".mkd"})
HTML_SUFFIXES = frozenset({".html", ".htm", ".xhtml"})

_BINARY_MAGIC = {
    b"\x89PNG": "a PNG image",
    b"\xff\xd8\xff": "a JPEG image",
    b"GIF8": "a GIF image",
    b"\x1f\x8b": "gzip-compressed data",
    b"\x7fELF": "an ELF executable",
    b"{\\rtf": "an RTF document",
}
_OLE_MAGIC = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"
# Password-protected DOCX/XLSX files are OLE compound files holding a stream of this name.
_OLE_ENCRYPTED_STREAM = "EncryptedPackage".encode("utf-16-le")
_CONTROL_BYTES = bytes(set(range(32)) - set(b"\t\n\r\f\v\x1b") | {0x7F})
# C0 and C1 controls and DEL, dropped from extracted text; a vertical tab or form feed (a page break) is a newline
_CONTROL_CHARS = {c: None for c in (*range(0x20), *range(0x7F, 0xA0)) if chr(c) not in "\t\n"} | {
    0x0B: "\n", 0x0C: "\n"}
# An HTML page may open with an XML declaration and comments before its first tag.
_HTML_START = re.compile(r"(\s|<\?xml[^>]*>|<!--.*?-->)*<(!doctype html|html|head|body)\b", re.DOTALL)


@dataclass(frozen=True)
class ExtractLimits:
    timeout_s: float = 60.0  # of the child's processor time (and ten times that of not running: a hang)
    memory_mb: int = 1024  # the child's address space (RLIMIT_AS, where enforced) and its resident memory
    max_bytes: int = 100 * 2**20  # for the file, and for a DOCX unpacked; checked before any parsing
    max_chars: int = 5_000_000  # longer text fails as too_large: never silent truncation

    def __post_init__(self) -> None:
        for field in fields(self):
            if not getattr(self, field.name) > 0:
                raise ValueError(f"ExtractLimits.{field.name} must be positive, got {getattr(self, field.name)!r}")


@dataclass(frozen=True)
class ExtractedText:
    text: str
    format: str  # one of FORMATS
    pages: int | None


def sniff_format(stream: BinaryIO, suffix: str) -> str:
    """The format of the seekable `stream`, judged by content; `suffix` ('.md') only breaks ties."""
    suffix = suffix.lower()
    head = stream.read(SNIFF_BYTES)
    stream.seek(0)
    if b"%PDF-" in head[:1024]:
        return "pdf"
    if head.startswith(b"PK\x03\x04"):
        return _zip_format(stream)
    if head.startswith(_OLE_MAGIC):
        if _OLE_ENCRYPTED_STREAM in stream.read():
            raise ExtractionError("encrypted", "Office document is encrypted (password required)")
        raise ExtractionError("unsupported", "legacy binary Office file (.doc/.xls/.ppt) is not supported")
    for magic, what in _BINARY_MAGIC.items():
        if head.startswith(magic):
            raise ExtractionError("unsupported", f"{what} is not a supported document")
    codec = bom_codec(head)
    if not codec and _looks_binary(head):
        raise ExtractionError("unsupported", f"binary content in {_describe(suffix)}")
    # Only the opening matters here, and markup is ASCII in every encoding a text file has without a BOM.
    start = head.decode(codec or "utf-8", errors="replace").lstrip().lower()
    if _HTML_START.match(start) or (suffix in HTML_SUFFIXES and start.startswith("<")):
        return "html"
    if suffix in MARKDOWN_SUFFIXES or re.match(r"#{1,6} \S", start):
        return "markdown"
    return "text"


def extract_bytes(data: bytes, suffix: str, limits: ExtractLimits) -> ExtractedText:
    """The text of a whole document held in memory (the extraction child's work)."""
    fmt = sniff_format(io.BytesIO(data), suffix)
    try:
        text, pages = _PARSERS[fmt](data, limits)
    except ImportError as err:
        message = f"reading this {_LABELS[fmt]} needs a Python package that will not import: {err}"
        raise MissingDependency(message, (err.name or "").partition(".")[0]) from err
    except (ExtractionError, MissingDependency, MemoryError):
        raise
    except Exception as err:  # parsers meet hostile input with every kind of exception; all mean the same
        message = f"{_LABELS[fmt]} could not be parsed: {type(err).__name__}: {err}"
        raise ExtractionError("corrupt", message) from err
    text = _tidy(text)
    if len(text) > limits.max_chars:
        raise ExtractionError(
            "too_large", f"extracted text has {len(text):,} characters, over the {limits.max_chars:,} limit"
        )
    if not text:
        raise ExtractionError("empty", f"{_LABELS[fmt]} contains no text")
    return ExtractedText(text, fmt, pages)


def _looks_binary(sample: bytes) -> bool:
    """True for bytes no text file would hold: NULs, or many control characters."""
    if b"\0" in sample:
        return True
    controls = len(sample) - len(sample.translate(None, _CONTROL_BYTES))
    return controls > MAX_CONTROL_RATIO * len(sample)


def _describe(suffix: str) -> str:
    return f"a {suffix} file" if suffix else "a file without extension"


def _tidy(text: str) -> str:
    """Unix newlines, no control characters but newline and tab (an escape sequence in a document must not reach a
    terminal that shows a passage), no lone surrogates (they cannot be encoded), no surrounding blank space."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").translate(_CONTROL_CHARS)
    return text.encode("utf-8", errors="replace").decode("utf-8").strip()


def _zip_format(stream: BinaryIO) -> str:
    try:
        names = zipfile.ZipFile(stream).namelist()
    except (zipfile.BadZipFile, EOFError, ValueError) as err:
        raise ExtractionError("corrupt", f"truncated or damaged ZIP container: {err}") from None
    if "word/document.xml" in names:
        return "docx"
    raise ExtractionError("unsupported", "ZIP archive is not a Word document (no word/document.xml)")


def _plain_text(data: bytes, limits: ExtractLimits) -> tuple[str, None]:
    return decode_text(data), None


def _html_text(data: bytes, limits: ExtractLimits) -> tuple[str, None]:
    return html_text(data), None


def _pdf_text(data: bytes, limits: ExtractLimits) -> tuple[str, int]:
    return pdf_text(data, limits.max_chars)


def _docx_text(data: bytes, limits: ExtractLimits) -> tuple[str, None]:
    return docx_text(data, limits.max_bytes), None


_PARSERS: dict[str, Callable[[bytes, ExtractLimits], tuple[str, int | None]]] = {
    "text": _plain_text,
    "markdown": _plain_text,
    "html": _html_text,
    "pdf": _pdf_text,
    "docx": _docx_text,
}
_LABELS = {
    "text": "text file",
    "markdown": "Markdown file",
    "html": "HTML page",
    "pdf": "PDF",
    "docx": "DOCX",
}
