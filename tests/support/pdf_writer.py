"""Minimal, valid PDFs for the tests: wrapped and paginated text, or raw content streams.

The sample PDF shipped with the daemon was written by this same layout: a letter page, 11-point Helvetica.
"""

from __future__ import annotations

import textwrap
import zlib
from collections.abc import Sequence

# A letter page with one-inch margins: 46 lines of 11-point Helvetica at 14-point leading, and 88 characters
# of prose (measured with the font metrics) fit within its 468-point measure.
PAGE_LINES = 46
LINE_CHARS = 88


def text_pdf(paragraphs: Sequence[str]) -> bytes:
    """A PDF with the paragraphs set in Helvetica, wrapped and paginated, one blank line between them."""
    lines: list[str] = []
    for paragraph in paragraphs:
        lines += [*textwrap.wrap(paragraph, LINE_CHARS, break_on_hyphens=False), ""]
    pages = [lines[start : start + PAGE_LINES] for start in range(0, len(lines), PAGE_LINES)]
    return pdf_bytes([zlib.compress(_text_stream(page)) for page in pages], flate_encoded=True)


def pdf_bytes(contents: Sequence[bytes], *, flate_encoded: bool = False) -> bytes:
    """A minimal, valid PDF: one page per content stream, font /F1 = Helvetica, an exact xref table.

    With `flate_encoded` the streams are taken as already zlib-compressed and marked /FlateDecode.
    """
    kids = b" ".join(b"%d 0 R" % (4 + 2 * page) for page in range(len(contents)))
    stream_filter = b" /Filter /FlateDecode" if flate_encoded else b""
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [%s] /Count %d >>" % (kids, len(contents)),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>",
    ]
    for page, content in enumerate(contents):
        objects.append(
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
            b"/Resources << /Font << /F1 3 0 R >> >> /Contents %d 0 R >>" % (5 + 2 * page)
        )
        objects.append(b"<< /Length %d%s >>\nstream\n%s\nendstream" % (len(content), stream_filter, content))
    out = bytearray(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")  # the binary comment marks the file as binary
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def _text_stream(lines: Sequence[str]) -> bytes:
    shown = b"".join(b"(%s) Tj T*\n" % _pdf_string(line) for line in lines)
    return b"BT /F1 11 Tf 14 TL 72 720 Td\n%sET" % shown


def _pdf_string(text: str) -> bytes:
    return text.encode("cp1252").replace(b"\\", b"\\\\").replace(b"(", b"\\(").replace(b")", b"\\)")
