"""Document formats: recognise one by its content and turn its bytes into plain text.

This module runs inside the extraction child process, so at the top it imports only the standard library
(and the jobs layer's exceptions, which import nothing else); pypdf and python-docx are imported by the one
parser that needs them.
"""

from __future__ import annotations

import codecs
import io
import re
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, fields
from html.parser import HTMLParser
from typing import BinaryIO

from npumoe.jobs.errors import ExtractionError

FORMATS = ("text", "markdown", "html", "pdf", "docx")

SNIFF_BYTES = 8192
MAX_CONTROL_RATIO = 0.05  # text has tabs and newlines, almost never other control bytes
MARKDOWN_SUFFIXES = frozenset({".md", ".markdown", ".mdown", ".mkd"})
HTML_SUFFIXES = frozenset({".html", ".htm", ".xhtml"})
# A DOCX part over a mebibyte that expands more than this looks like a zip bomb, not repetitive XML.
MAX_DOCX_RATIO = 200
RATIO_CHECK_BYTES = 2**20

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
# UTF-32 first: its little-endian BOM starts with the UTF-16 one.
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)
# Tried in order when there is no BOM; latin-1 decodes anything, so it comes last.
_FALLBACK_CODECS = ("utf-8", "cp1252", "latin-1")
_CONTROL_BYTES = bytes(set(range(32)) - set(b"\t\n\r\f\v\x1b") | {0x7F})
# An HTML page may open with an XML declaration and comments before its first tag.
_HTML_START = re.compile(r"(\s|<\?xml[^>]*>|<!--.*?-->)*<(!doctype html|html|head|body)\b", re.DOTALL)


@dataclass(frozen=True)
class ExtractLimits:
    timeout_s: float = 60.0
    memory_mb: int = 1024  # address-space cap for the child (RLIMIT_AS on Linux; best effort on macOS)
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
    if not _bom_codec(head) and _looks_binary(head):
        raise ExtractionError("unsupported", f"binary content in {_describe(suffix)}")
    start = _decode_text(head).lstrip().lower()
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
    except (ExtractionError, MemoryError):
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


def _decode_text(data: bytes) -> str:
    """Text from bytes: by BOM when there is one, else UTF-8, else the Windows and Latin-1 code pages."""
    codec = _bom_codec(data)
    if codec:
        return data.decode(codec, errors="replace")
    for codec in _FALLBACK_CODECS:
        try:
            return data.decode(codec)
        except UnicodeDecodeError:
            continue
    raise AssertionError("latin-1 decodes every byte string")


def _bom_codec(data: bytes) -> str | None:
    return next((codec for bom, codec in _BOMS if data.startswith(bom)), None)


def _describe(suffix: str) -> str:
    return f"a {suffix} file" if suffix else "a file without extension"


def _tidy(text: str) -> str:
    """Unix newlines, no lone surrogates (they cannot be encoded), no surrounding blank space."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
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
    return _decode_text(data), None


class _HtmlText(HTMLParser):
    """Collects visible text, one line per block element; streaming, so nesting depth costs nothing."""

    SKIPPED = frozenset({"script", "style", "template", "noscript"})
    BLOCKS = frozenset(
        {
            *("address", "article", "aside", "blockquote", "br", "dd", "div", "dl", "dt", "figcaption"),
            *("figure", "footer", "h1", "h2", "h3", "h4", "h5", "h6", "header", "hr", "li", "main", "nav"),
            *("ol", "p", "pre", "section", "table", "td", "th", "title", "tr", "ul"),
        }
    )

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skipping = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.SKIPPED:
            self._skipping += 1
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in self.SKIPPED:
            self._skipping = max(0, self._skipping - 1)
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if not self._skipping:
            self.parts.append(data)


def _html_text(data: bytes, limits: ExtractLimits) -> tuple[str, None]:
    parser = _HtmlText()
    parser.feed(_decode_text(data))
    parser.close()
    # HTML collapses whitespace inside a block; blocks become paragraphs separated by one blank line.
    lines = (" ".join(line.split()) for line in "".join(parser.parts).split("\n"))
    return "\n\n".join(line for line in lines if line), None


def _pdf_text(data: bytes, limits: ExtractLimits) -> tuple[str, int]:
    from pypdf import PasswordType, PdfReader
    from pypdf.errors import DependencyError, LimitReachedError

    # pypdf may patch up a cut-off file and return part of it; a missing end marker is the plain sign.
    if b"%%EOF" not in data[-1024:]:
        raise ExtractionError("corrupt", "PDF is truncated (no %%EOF marker at the end)")
    reader = PdfReader(io.BytesIO(data))
    if reader.is_encrypted:
        # Many PDFs are encrypted only to carry permissions, with an empty password for reading.
        try:
            locked = reader.decrypt("") == PasswordType.NOT_DECRYPTED
        except DependencyError:
            raise ExtractionError(
                "encrypted", "PDF is AES-encrypted; reading it needs the cryptography package"
            ) from None
        if locked:
            raise ExtractionError("encrypted", "PDF is encrypted (password required)")
    pages: list[str] = []
    length = 0
    try:
        for page in reader.pages:
            pages.append(page.extract_text())
            length += len(pages[-1])
            if length > limits.max_chars:
                raise ExtractionError("too_large", f"PDF text exceeds the {limits.max_chars:,} character limit")
    except LimitReachedError as err:
        raise ExtractionError("too_large", f"PDF stream expands past the decompression limit ({err})") from None
    return "\n\n".join(pages), len(pages)


def _docx_text(data: bytes, limits: ExtractLimits) -> tuple[str, None]:
    _refuse_zip_bomb(zipfile.ZipFile(io.BytesIO(data)), limits.max_bytes)
    import docx
    from docx.table import Table

    blocks: list[str] = []
    for block in docx.Document(io.BytesIO(data)).iter_inner_content():
        if isinstance(block, Table):
            blocks.extend(" | ".join(cell.text for cell in row.cells) for row in block.rows)
        else:
            blocks.append(block.text)
    return "\n\n".join(block for block in blocks if block.strip()), None


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
