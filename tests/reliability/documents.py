"""Distinct small documents for the reliability tests, in every format the daemon reads.

Each document's text is made from its number, so no two share content (the queue keys work by sha256).
`write` returns the sha256 of every file it wrote, which is what the audit counts results by.
"""

from __future__ import annotations

import hashlib
import io
import random
from pathlib import Path

import docx
from support.pdf_writer import text_pdf

FORMATS = (".md", ".txt", ".html", ".docx", ".pdf")
WORDS = (
    "harbour", "lamp", "tide", "ledger", "porter", "archive", "quiet", "night", "shift", "report", "queue",
    "summary", "chapter", "river", "lantern", "clerk", "window", "morning", "bell", "record", "station",
    "signal", "letter", "route", "market", "winter", "garden",
)


def paragraphs(number: int, count: int, words: tuple[int, int] = (30, 50)) -> list[str]:
    """`count` paragraphs of made-up prose, each of `words` (low, high) words, different for every `number`."""
    rng = random.Random(number)
    return [
        f"Document {number}, part {p}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))) + "."
        for p in range(count)
    ]


def render(suffix: str, title: str, body: list[str]) -> bytes:
    """The bytes of a document in the format that `suffix` names."""
    if suffix == ".md":
        return (f"# {title}\n\n" + "\n\n".join(body) + "\n").encode()
    if suffix == ".txt":
        return (title + "\n\n" + "\n\n".join(body) + "\n").encode()
    if suffix == ".html":
        ps = "".join(f"<p>{p}</p>" for p in body)
        return f"<!DOCTYPE html><html><head><title>{title}</title></head><body>{ps}</body></html>".encode()
    if suffix == ".pdf":
        return text_pdf([title, *body])
    if suffix == ".docx":
        word = docx.Document()
        word.add_heading(title, level=1)
        for p in body:
            word.add_paragraph(p)
        out = io.BytesIO()
        word.save(out)
        return out.getvalue()
    raise ValueError(f"no writer for {suffix!r} documents (known: {', '.join(FORMATS)})")


def write(folder: Path, numbers: range, *, paragraphs_each: int = 1, words: tuple[int, int] = (30, 50),
          formats: tuple[str, ...] = (".txt",)) -> dict[str, str]:
    """Write document `n` for each n in `numbers` into `folder`, cycling through `formats`: sha256 -> name."""
    written = {}
    for n in numbers:
        suffix = formats[n % len(formats)]
        data = render(suffix, f"Document {n}", paragraphs(n, paragraphs_each, words))
        name = f"doc-{n:05d}{suffix}"
        (folder / name).write_bytes(data)
        written[hashlib.sha256(data).hexdigest()] = name
    return written
