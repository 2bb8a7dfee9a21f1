"""PDFs as real tools write them: AES encryption by pypdf's writer, a scanned page by Pillow, a mail footer
after the end marker; each ends in its text or in the error that says what actually went wrong."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from extraction import LIMITS, extraction_error, words
from PIL import Image, ImageDraw
from pypdf import PdfReader, PdfWriter
from support.blocked_imports import block_imports
from support.pdf_writer import pdf_bytes, text_pdf

from npumoe.jobs.errors import MissingDependency
from npumoe.jobs.extract.isolated import extract_text

PARAGRAPHS = [
    "The quarterly minutes were sealed with a password that nobody needs to read them.",
    "Encryption that only carries permissions still leaves the text open to every viewer.",
]
AES = ("AES-128", "AES-256")


def encrypted_pdf(path: Path, algorithm: str, user_password: str) -> Path:
    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(text_pdf(PARAGRAPHS))))
    writer.encrypt(user_password=user_password, owner_password="owner-secret", algorithm=algorithm)
    writer.write(path)
    return path


def scanned_pdf(path: Path) -> Path:
    """What a scanner's PDF export holds: one image per page, no text layer."""
    page = Image.new("L", (425, 550), 255)
    draw = ImageDraw.Draw(page)
    for y in range(60, 500, 18):  # lines of "print" the way a scan shows them: pixels, not characters
        draw.line([(40, y), (385, y)], fill=0, width=4)
    page.save(path, resolution=50)
    return path


@pytest.mark.parametrize("algorithm", AES)
def test_an_aes_pdf_with_only_an_owner_password_gives_its_text(tmp_path: Path, algorithm: str) -> None:
    path = encrypted_pdf(tmp_path / "minutes.pdf", algorithm, user_password="")
    assert PdfReader(path).is_encrypted

    text = words(extract_text(path, LIMITS).text)

    for paragraph in PARAGRAPHS:
        assert paragraph in text


@pytest.mark.parametrize("algorithm", AES)
def test_an_aes_pdf_that_needs_a_user_password_is_encrypted(tmp_path: Path, algorithm: str) -> None:
    path = encrypted_pdf(tmp_path / "locked.pdf", algorithm, user_password="reader-secret")

    error = extraction_error(path)

    assert error.kind == "encrypted"
    assert "password required" in str(error)


@pytest.mark.parametrize("algorithm", AES)
def test_without_the_cryptography_package_an_aes_pdf_is_the_machines_fault_not_corrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, algorithm: str
) -> None:
    path = encrypted_pdf(tmp_path / "minutes.pdf", algorithm, user_password="")
    block_imports(tmp_path / "blocked", monkeypatch, "cryptography")

    with pytest.raises(MissingDependency) as caught:
        extract_text(path, LIMITS)

    assert "cryptography" in str(caught.value)


def test_bytes_after_the_end_marker_are_tolerated_as_viewers_do(tmp_path: Path) -> None:
    footer = b"\r\n-- \r\nThis message was scanned by the mail gateway and found clean.\r\n" * 100
    path = tmp_path / "forwarded.pdf"
    path.write_bytes(text_pdf(PARAGRAPHS) + footer + bytes(2048))
    assert len(footer) + 2048 > 1024

    assert PARAGRAPHS[0] in words(extract_text(path, LIMITS).text)


def test_a_pdf_cut_before_any_end_marker_is_still_corrupt(tmp_path: Path) -> None:
    data = text_pdf(PARAGRAPHS * 30)
    path = tmp_path / "cut.pdf"
    path.write_bytes(data[: len(data) // 2])

    assert extraction_error(path).kind == "corrupt"


def test_a_scanned_pdf_has_no_text_layer_not_empty(tmp_path: Path) -> None:
    error = extraction_error(scanned_pdf(tmp_path / "scan.pdf"))

    assert error.kind == "no_text_layer"
    assert "no text layer: scanned image; OCR is not supported" in str(error)


def test_an_inline_image_counts_as_a_scan_too(tmp_path: Path) -> None:
    path = tmp_path / "fax.pdf"
    gray_2x2 = b"q 200 0 0 200 100 400 cm BI /W 2 /H 2 /CS /G /BPC 8 ID \x00\xff\xff\x00 EI Q"
    path.write_bytes(pdf_bytes([gray_2x2]))

    assert extraction_error(path).kind == "no_text_layer"
