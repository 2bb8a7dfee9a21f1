"""Hostile inputs for extraction and the daemon: one generator per case, each documenting its outcome.

Every generator writes its case into `directory` and returns the path to hand to `extract_text` (or to drop
into the inbox). EXPECTED maps each case of `make_all` to the ExtractionError kind `extract_text` must raise,
or None where the file must extract normally. Bomb and huge-file sizes are parameters, so tests stay fast.
"""

from __future__ import annotations

import io
import os
import random
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

import docx
from pypdf import PdfReader, PdfWriter

from support.pdf_writer import pdf_bytes, text_pdf

SENTENCE = "The porter wrote one line in the log and went back to the quiet of the night."
BOMB_BYTES = 128 * 2**20  # past pypdf's 75 MB stream limit and past a test's max_bytes
HUGE_BYTES = 2**30 + 1  # past the default 100 MiB max_bytes; sparse, so it costs no disk

EXPECTED: dict[str, str | None] = {
    "zero_bytes": "empty",
    "whitespace_only": "empty",
    "huge_file": "too_large",
    "binary_with_text_extension": "unsupported",
    "invalid_utf8": None,
    "deeply_nested_html": None,
    "pdf_decompression_bomb": "too_large",
    "encrypted_pdf": "encrypted",
    "owner_locked_pdf": None,
    "password_protected_docx": "encrypted",
    "truncated_pdf": "corrupt",
    "truncated_docx": "corrupt",
    "zip_bomb_docx": "too_large",
    "symlink_outside": "unreadable",
    "symlink_loop": "unreadable",
    "fifo": "unreadable",
    "deleted_after_seen": "missing",
    "unreadable_file": "unreadable",
    "name_with_newline": None,
    "name_with_unicode": None,
    "name_with_dotdot": None,
}


def make_all(directory: Path, *, bomb_bytes: int = BOMB_BYTES, huge_bytes: int = HUGE_BYTES) -> dict[str, Path]:
    """Every case of EXPECTED, written into `directory` by the generator of the same name: case -> path."""
    sized: dict[str, Callable[[Path], Path]] = {
        "huge_file": lambda d: huge_file(d, huge_bytes),
        "pdf_decompression_bomb": lambda d: pdf_decompression_bomb(d, bomb_bytes),
        "zip_bomb_docx": lambda d: zip_bomb_docx(d, bomb_bytes),
    }
    return {name: sized.get(name, globals()[name])(directory) for name in EXPECTED}


def permissions_enforced(path: Path) -> bool:
    """False when this process may read a mode-000 file anyway (root does): then unreadable_file proves nothing."""
    return not os.access(path, os.R_OK)


def zero_bytes(directory: Path) -> Path:
    """A 0-byte .txt -> "empty", decided before any child process starts."""
    return _write(directory / "zero.txt", b"")


def whitespace_only(directory: Path) -> Path:
    """Spaces, tabs and newlines in a .md -> "empty" (no text after extraction)."""
    return _write(directory / "blank.md", b" \t\n\r\n   \n" * 50)


def huge_file(directory: Path, size: int = HUGE_BYTES) -> Path:
    """A sparse .txt of `size` bytes -> "too_large" when size > max_bytes, from its size alone, nothing read."""
    path = directory / "huge.txt"
    with path.open("wb") as file:
        file.truncate(size)
    return path


def binary_with_text_extension(directory: Path) -> Path:
    """64 KiB of random bytes named .txt -> "unsupported" ("binary content in a .txt file")."""
    return _write(directory / "binary.txt", random.Random(0).randbytes(64 * 2**10))


def invalid_utf8(directory: Path) -> Path:
    """Windows-1252 text, invalid as UTF-8 -> extracts through the code-page fallback; the text holds "café"."""
    return _write(directory / "latin.txt", f"Menu of the café: “{SENTENCE}”\n".encode("cp1252"))


def deeply_nested_html(directory: Path, depth: int = 100_000) -> Path:
    """`depth` nested <div>s around one sentence -> extracts that sentence (no recursion anywhere)."""
    body = "<div>" * depth + f"<p>{SENTENCE}</p>" + "</div>" * depth
    return _write(directory / "nested.html", f"<!DOCTYPE html><html><body>{body}</body></html>".encode())


def pdf_decompression_bomb(directory: Path, expanded_bytes: int = BOMB_BYTES) -> Path:
    """A PDF page whose content stream inflates to `expanded_bytes` of zeros from a few hundred KiB.

    -> "too_large" (pypdf stops inflating at 75 MB) when memory_mb leaves room for that; "memory" under
    a tighter cap (about 128 MiB), which the child hits first.
    """
    deflate = zlib.compressobj(9)
    chunk = bytes(2**20)
    stream = b"".join(deflate.compress(chunk) for _ in range(expanded_bytes // len(chunk))) + deflate.flush()
    return _write(directory / "bomb.pdf", pdf_bytes([stream], flate_encoded=True))


def encrypted_pdf(directory: Path) -> Path:
    """A PDF that needs the user password "secret" -> "encrypted"."""
    return _write(directory / "encrypted.pdf", _encrypted_pdf(user_password="secret"))


def owner_locked_pdf(directory: Path) -> Path:
    """A PDF encrypted with an owner password only (an empty user password) -> extracts; holds SENTENCE."""
    return _write(directory / "owner-locked.pdf", _encrypted_pdf(user_password=""))


def password_protected_docx(directory: Path) -> Path:
    """What Word writes for a password-protected .docx: an OLE compound file with an EncryptedPackage stream.

    -> "encrypted". Only the OLE signature and the stream's directory name are real here, which is all that
    extraction looks at; this is not a complete compound file.
    """
    header = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + bytes(504)
    entry = "EncryptedPackage".encode("utf-16-le").ljust(128, b"\0")
    return _write(directory / "protected.docx", header + entry + random.Random(1).randbytes(4096))


def truncated_pdf(directory: Path) -> Path:
    """The first half of a valid PDF, as a copy cut short leaves it -> "corrupt"."""
    data = text_pdf([SENTENCE] * 40)
    return _write(directory / "truncated.pdf", data[: len(data) // 2])


def truncated_docx(directory: Path) -> Path:
    """The first half of a valid DOCX (its ZIP directory is at the end, so it is lost) -> "corrupt"."""
    word = docx.Document()
    for _ in range(40):
        word.add_paragraph(SENTENCE)
    out = io.BytesIO()
    word.save(out)
    data = out.getvalue()
    return _write(directory / "truncated.docx", data[: len(data) // 2])


def zip_bomb_docx(directory: Path, expanded_bytes: int = BOMB_BYTES) -> Path:
    """A well-formed DOCX whose document.xml inflates to `expanded_bytes` of blank space -> "too_large",
    refused from the sizes the ZIP declares, before anything is inflated."""
    path = directory / "bomb.docx"
    chunk = b" " * 2**20
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
        archive.writestr("[Content_Types].xml", _CONTENT_TYPES)
        archive.writestr("_rels/.rels", _PACKAGE_RELS)
        with archive.open("word/document.xml", "w", force_zip64=expanded_bytes >= 2**31) as part:
            part.write(b'<w:document xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"><w:body>')
            for _ in range(expanded_bytes // len(chunk)):
                part.write(chunk)
            part.write(b"</w:body></w:document>")
    return path


def symlink_outside(directory: Path, target: Path = Path("/etc/passwd")) -> Path:
    """A .txt symlink to a readable file outside `directory` -> "unreadable": extraction never follows links."""
    path = directory / "outside.txt"
    path.symlink_to(target)
    return path


def symlink_loop(directory: Path) -> Path:
    """Two symlinks pointing at each other -> "unreadable", at once (no ELOOP wait, no recursion)."""
    first, second = directory / "loop-a.txt", directory / "loop-b.txt"
    first.symlink_to(second)
    second.symlink_to(first)
    return first


def fifo(directory: Path) -> Path:
    """A named pipe called .txt with no writer -> "unreadable" without blocking: it is never opened."""
    path = directory / "pipe.txt"
    os.mkfifo(path)
    return path


def deleted_after_seen(directory: Path) -> Path:
    """A file that existed and was removed, as when a user deletes it after the watcher saw it -> "missing"."""
    path = _write(directory / "gone.txt", SENTENCE.encode())
    path.unlink()
    return path


def unreadable_file(directory: Path) -> Path:
    """A text file with mode 000 -> "unreadable" ("permission denied"), except for root, which reads it anyway:
    check `permissions_enforced(path)` before expecting the error."""
    path = _write(directory / "locked.txt", SENTENCE.encode())
    path.chmod(0)
    return path


def name_with_newline(directory: Path) -> Path:
    """A valid text file whose name holds a newline -> extracts; logs and meta files must quote the name."""
    return _write(directory / "two\nlines.txt", SENTENCE.encode())


def name_with_unicode(directory: Path) -> Path:
    """A valid Markdown file named in several scripts, with an emoji and a combining accent -> extracts."""
    return _write(directory / "naïve résumé 東京 📄 e\u0301.md", f"# Notes\n\n{SENTENCE}\n".encode())


def name_with_dotdot(directory: Path) -> Path:
    """A path spelled through `nested/..` that still names a file inside `directory` -> extracts; the daemon's
    confinement check has to resolve such paths before judging them."""
    (directory / "nested").mkdir(exist_ok=True)
    _write(directory / "dotdot.txt", SENTENCE.encode())
    return directory / "nested" / ".." / "dotdot.txt"


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _encrypted_pdf(user_password: str) -> bytes:
    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(text_pdf([SENTENCE]))))
    # RC4 needs no optional crypto package; pypdf would need `cryptography` to write (or read) AES.
    writer.encrypt(user_password=user_password, owner_password="owner", algorithm="RC4-128")
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


_CONTENT_TYPES = (
    '<?xml version="1.0" encoding="UTF-8"?>'
    '<Types xmlns="http://schemas.openxmlformats.org/package/2006/content-types">'
    '<Default Extension="rels" ContentType="application/vnd.openxmlformats-package.relationships+xml"/>'
    '<Default Extension="xml" ContentType="application/xml"/>'
    '<Override PartName="/word/document.xml" '
    'ContentType="application/vnd.openxmlformats-officedocument.wordprocessingml.document.main+xml"/>'
    "</Types>"
)
_PACKAGE_RELS = (
    '<?xml version="1.0" encoding="UTF-8"?>'
    '<Relationships xmlns="http://schemas.openxmlformats.org/package/2006/relationships">'
    '<Relationship Id="rId1" Target="word/document.xml" '
    'Type="http://schemas.openxmlformats.org/officeDocument/2006/relationships/officeDocument"/>'
    "</Relationships>"
)
