"""Bytes to text: by byte-order mark, then UTF-8 (even slightly damaged), then charset-normalizer's detection.

HTML adds one step before detection: the charset the page declares, as a browser honours it. This module runs
in the extraction child and in the parent's format sniffing, so charset-normalizer is imported only when a
file is neither marked by a BOM nor UTF-8.
"""

from __future__ import annotations

import codecs
import re

# UTF-32 first: its little-endian BOM starts with the UTF-16 one.
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)
_REPLACEMENT_UTF8 = "\ufffd".encode()
# Browsers look for the declaration in the first 1,024 bytes: <meta charset=…>, <meta http-equiv=… content=
# "…; charset=…">, or an XHTML page's XML declaration.
DECLARATION_BYTES = 1024
_DECLARED = re.compile(
    rb"<meta\s[^>]*?charset\s*=\s*[\"']?\s*([-\w.:]+)|<\?xml\s[^>]*?encoding\s*=\s*[\"']([-\w.:]+)", re.IGNORECASE
)
# The HTML standard reads these labels as windows-1252, and a UTF-16 label found by an ASCII scan as UTF-8.
_HTML_LABELS = {
    "iso-8859-1": "cp1252",
    "latin1": "cp1252",
    "latin-1": "cp1252",
    "ascii": "cp1252",
    "us-ascii": "cp1252",
    "utf-16": "utf-8",
    "utf-16le": "utf-8",
    "utf-16be": "utf-8",
}


def bom_codec(data: bytes) -> str | None:
    """The codec a byte-order mark at the start of `data` names, or None."""
    return next((codec for bom, codec in _BOMS if data.startswith(bom)), None)


def decode_text(data: bytes) -> str:
    """Text from bytes of an unknown encoding; never raises, undecodable bytes become U+FFFD."""
    codec = bom_codec(data)
    if codec:
        return data.decode(codec, errors="replace")
    utf8 = data.decode("utf-8", errors="replace")
    if _mostly_utf8(data, utf8):
        return utf8
    from charset_normalizer import from_bytes

    best = from_bytes(data).best()
    # No code page reads it cleanly either: UTF-8 with visible replacements says so honestly.
    return str(best) if best is not None else utf8


def decode_html(data: bytes) -> str:
    """An HTML page's text: a BOM wins, then the charset the page declares, then detection as for text."""
    codec = None if bom_codec(data) else declared_charset(data)
    return data.decode(codec, errors="replace") if codec else decode_text(data)


def declared_charset(data: bytes) -> str | None:
    """The Python codec for the charset the page declares near its start; None if absent or unknown."""
    found = _DECLARED.search(data[:DECLARATION_BYTES])
    if not found:
        return None
    label = (found[1] or found[2]).decode("ascii").lower()
    label = _HTML_LABELS.get(label, label)
    try:
        return codecs.lookup(label).name
    except LookupError:
        return None


def _mostly_utf8(data: bytes, decoded: str) -> bool:
    """True when `data` is UTF-8, perhaps with a few damaged bytes: its valid multi-byte characters outnumber
    the invalid sequences. Text in a legacy code page forms valid UTF-8 sequences only by chance, far less
    often than invalid ones (a quarter as often in GBK or Shift_JIS, almost never in the Cyrillic and Western
    pages), while a UTF-8 file with one stray byte has one invalid sequence among many valid ones."""
    invalid = decoded.count("\ufffd") - data.count(_REPLACEMENT_UTF8)
    if invalid == 0:
        return True
    non_ascii = len(decoded) - len(decoded.encode("ascii", errors="ignore"))
    return non_ascii - invalid > invalid
