"""PDF to text with pypdf; each failure is told apart: encrypted, truncated, too large, scanned, or our machine's.

An AES-encrypted PDF needs the `cryptography` package to be read at all, even with the empty password most such
files have (encryption that only carries permissions): without it pypdf raises DependencyError, which is the
machine's fault (MissingDependency), never the document's.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from ..errors import ExtractionError, MissingDependency

if TYPE_CHECKING:
    from pypdf import PdfReader
    from pypdf.generic import PdfObject

SCANNED = "no text layer: scanned image; OCR is not supported"


def pdf_text(data: bytes, max_chars: int) -> tuple[str, int]:
    """The text of every page, pages separated by a blank line, and the page count."""
    from pypdf.errors import DependencyError

    try:
        return _read(data, max_chars)
    except DependencyError as err:
        raise MissingDependency(f"reading this PDF needs a package that is not installed: {err}",
                                "cryptography") from err  # pypdf's only optional dependency for text


def _read(data: bytes, max_chars: int) -> tuple[str, int]:
    from pypdf import PasswordType, PdfReader
    from pypdf.errors import LimitReachedError

    # pypdf may patch up a cut-off file and return part of it; a missing end marker is the plain sign. Bytes
    # after the marker (a mail gateway's footer, padding) are tolerated, as every viewer does.
    if b"%%EOF" not in data:
        raise ExtractionError("corrupt", "PDF is truncated (no %%EOF end marker)")
    reader = PdfReader(io.BytesIO(data))
    # Many PDFs are encrypted only to carry permissions, with an empty password for reading.
    if reader.is_encrypted and reader.decrypt("") == PasswordType.NOT_DECRYPTED:
        raise ExtractionError("encrypted", "PDF is encrypted (password required)")
    pages: list[str] = []
    length = 0
    try:
        for page in reader.pages:
            pages.append(page.extract_text())
            length += len(pages[-1])
            if length > max_chars:
                raise ExtractionError("too_large", f"PDF text exceeds the {max_chars:,} character limit")
        if not any(text.strip() for text in pages) and _has_images(reader):
            raise ExtractionError("no_text_layer", f"PDF has {SCANNED}")
    except LimitReachedError as err:
        raise ExtractionError("too_large", f"PDF stream expands past the decompression limit ({err})") from None
    return "\n\n".join(pages), len(pages)


def _has_images(reader: PdfReader) -> bool:
    """True when some page draws an image: an image XObject (directly or inside a form) or an inline image."""
    for page in reader.pages:
        if _resources_hold_image(page.get("/Resources"), set()):
            return True
        contents = page.get_contents()
        if contents is not None and any(operator == b"INLINE IMAGE" for _, operator in contents.operations):
            return True
    return False


def _resources_hold_image(resources: PdfObject | None, seen: set[int]) -> bool:
    """Walk a resource dictionary's XObjects, into forms, without visiting one object twice (forms may loop).
    pypdf caches each object it resolves, so an object's id() names it."""
    stack = [resources]
    while stack:
        current = stack.pop()
        if current is None:
            continue
        xobjects = current.get_object().get("/XObject")
        if xobjects is None:
            continue
        for ref in xobjects.get_object().values():
            xobject = ref.get_object()
            if id(xobject) in seen:
                continue
            seen.add(id(xobject))
            if xobject.get("/Subtype") == "/Image":
                return True
            if xobject.get("/Subtype") == "/Form":
                stack.append(xobject.get("/Resources"))
    return False
