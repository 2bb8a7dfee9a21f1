"""Sample documents the project writes itself, for `make demo` and the tests.

Six documents in five formats and three lengths, composed deterministically from the sentences below (original
prose about the very work the daemon does): a short note, a Markdown essay that needs several prefill chunks,
an HTML page, a PDF, a DOCX, and a log longer than a small demo model's whole context.
"""

from __future__ import annotations

import html
import io
import random
import textwrap
import zipfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

SENTENCES: dict[str, tuple[str, ...]] = {
    "queues": (
        "A queue is a promise that work will be done later, and a good one keeps that promise even when the "
        "machine is switched off halfway through.",
        "The simplest queue worth trusting is a single table with a handful of states and one statement that "
        "claims the next job.",
        "Every job that is claimed carries a lease, and a lease that is not renewed quietly returns the job to "
        "the pile.",
        "Retrying immediately after a failure usually meets the same failure, so each attempt waits a little "
        "longer than the one before.",
        "A small random delay added to each retry keeps a crowd of failed jobs from waking up at the same instant.",
        "Processing the same document twice wastes an evening of battery, which is why each file is known by the "
        "hash of its contents.",
        "Nobody reads a queue for pleasure, but everybody reads it when something has gone wrong, so its states "
        "should say plainly what happened.",
        "A job that has failed too many times is set aside with its last error written next to it, not retried "
        "forever.",
        "The worker never holds a transaction open while it thinks; it claims, lets go, works, and then reports.",
        "A dead worker leaves no note, so the queue notices its absence by the silence of its heartbeat.",
        "Fairness in a document queue mostly means that a single enormous report cannot starve twenty short letters.",
        "When the queue is empty the worker should sleep deeply rather than ask every second whether anything "
        "has changed.",
        "It is tempting to add priorities, tags and dependencies, yet most personal queues need nothing more than "
        "first come, first served.",
        "The honest measure of a queue is not how fast it drains on a quiet day but how calmly it recovers from a "
        "bad one.",
    ),
    "energy": (
        "A laptop on battery is a small island of stored energy, and every background task spends some of it "
        "without asking.",
        "The cheapest computation is the one postponed until the charger is connected.",
        "Low Power Mode is a clear request from the person at the keyboard, and a polite daemon treats it as a "
        "reason to wait.",
        "Fans that spin up while someone is writing a letter are a sign that the background has forgotten its place.",
        "Specialised accelerators often finish the same arithmetic with a fraction of the energy a general "
        "processor would spend.",
        "Measuring energy honestly is harder than measuring time, so a careful tool reports it only where the "
        "platform can count it.",
        "Processor seconds are a useful proxy: the kernel counts them for every process and they cannot be flattered.",
        "A battery kept above a comfortable threshold ages more slowly than one drained to the last percent "
        "every night.",
        "Heat is the visible part of wasted work, and a machine that stays cool under load is usually being used "
        "wisely.",
        "An overnight window lets heavy work happen while the house is asleep and the electricity is often cheaper.",
        "When the machine wakes for a scheduled task, it should do that task, write its results and go back to sleep.",
        "Spreading a long job over many short bursts can cost more energy than running it once, because every "
        "start has a price.",
        "Nobody notices a daemon that behaves well, and that invisibility is the best praise it can receive.",
        "A budget for background processor time is easier to keep when it is written down as a number rather "
        "than a feeling.",
    ),
    "archives": (
        "Long documents are rarely read from beginning to end; they are searched, skimmed and summarised.",
        "An archive is only as useful as the index that points into it, and a good summary is a kind of index.",
        "Old reports often begin with a page of acknowledgements and end with appendices that nobody has opened "
        "in years.",
        "A summary that hides what it left out is worse than no summary, because it invites trust it has not earned.",
        "When a text is longer than a reader can hold in mind, it is split into parts, each part is summarised, "
        "and the summaries are summarised again.",
        "Tables and footnotes carry much of the meaning in technical writing, yet they are the first things lost "
        "when a document is flattened into text.",
        "A scanned page without a text layer is only a picture of words, and extraction has nothing to read there.",
        "The same contract can arrive as a PDF, a word-processor file and an email, and a careful system reads "
        "all three the same way.",
        "Archivists have long known that the format of a document outlives the program that wrote it, sometimes "
        "by decades.",
        "Page numbers are a habit of paper that survives in digital files, long after anyone has printed them.",
        "A reader looking for one clause in a two-hundred-page agreement wants to be taken there directly, not "
        "told that the agreement is long.",
        "Good extraction keeps paragraphs apart, because the blank line between two ideas is itself information.",
        "Files named final, final-2 and final-really are a small history of how people actually work.",
        "Every archive holds documents that were never meant to be kept, and some of them turn out to be the "
        "most revealing.",
    ),
    "accelerators": (
        "A neural accelerator is fastest when it knows in advance the exact shape of every array it will be "
        "asked to multiply.",
        "Static shapes trade flexibility for speed: the graph is compiled once, and every call must fit the mould.",
        "Text does not arrive in convenient sizes, so it is cut into chunks of a fixed length and the last chunk "
        "is padded.",
        "Launching work on an accelerator has a fixed cost, and many tiny launches can take longer than one large one.",
        "Packing several small pieces of work into one call is the oldest trick for hiding that fixed cost.",
        "A graph that branches on the data cannot be compiled ahead of time, so the branching is done on the "
        "host before the call.",
        "The host processor remains the conductor: it routes, packs, gathers and combines, while the accelerator "
        "does the heavy arithmetic.",
        "Memory traffic, not arithmetic, is often what limits a model running on a small device.",
        "Compiling a graph can take minutes, which is why a compiled graph is stored and reused rather than "
        "rebuilt every morning.",
        "A reference implementation on the processor keeps the accelerator honest, since both should produce "
        "the same numbers.",
        "Half-precision arithmetic halves the memory a model needs, at the price of a little accuracy that must "
        "be checked, not assumed.",
        "Some operations are simply not supported by a given accelerator, and they fall back to the processor "
        "without ceremony.",
        "The best schedule keeps both the processor and the accelerator busy at the same time, each with the "
        "work it does best.",
        "Measuring the cost of a launch on the actual machine beats any estimate written down in advance.",
    ),
    "experts": (
        "A mixture-of-experts model resembles a large committee in which each word consults only the few "
        "members most likely to help.",
        "The router is the committee's secretary: it reads each token and decides which experts should see it.",
        "Because each token visits only a few experts, the model can hold a great deal of knowledge while doing "
        "modest work per word.",
        "Some experts are popular and others are rarely asked, and the difference is often stable from one "
        "document to the next.",
        "Calibration means watching the committee at work on ordinary text and writing down how busy each "
        "member tends to be.",
        "An expert given a fixed capacity can accept only so many tokens at once, and the rest must wait, be "
        "dropped or go elsewhere.",
        "Dropping a token from an expert is cheaper than processing it, but the loss should be counted and "
        "reported, never hidden.",
        "Sending overflow tokens to the processor keeps the answer exact while the accelerator handles the "
        "common case.",
        "Grouping experts of similar load lets one compiled graph serve several of them in a single call.",
        "The rarely used experts ask so little that running them on the processor is cheaper than waking the "
        "accelerator.",
        "A plan that records which experts stay resident is a piece of data that can be printed, compared and reused.",
        "Importance is a useful tiebreak: when space runs out, the tokens with the smallest routing weight are "
        "the first to give way.",
        "A committee that is well organised reaches the same decision as one that is not, only sooner and with "
        "less fuss.",
        "The routing weights themselves are cheap to compute, which is why the host can afford to make every decision.",
    ),
    "night": (
        "By late evening the house is quiet, the laptop lid is closed, and the inbox folder still holds the "
        "day's unread reports.",
        "Work that can wait until night is a gift to the person who would otherwise sit watching a progress bar.",
        "A status line that says why the machine is waiting is more reassuring than one that says nothing at all.",
        "Morning brings a short summary for every document that arrived, and the originals are tidied away "
        "where they belong.",
        "The best background helpers are like a good night porter: present, reliable and almost never seen.",
        "A file dropped into a folder is a request made without ceremony, and the folder should answer it "
        "without ceremony too.",
        "Sometimes a document cannot be read at all, and the most helpful answer is a short, exact sentence "
        "saying why.",
        "Patience is built into the design: a file is left alone until it has stopped changing, in case it is "
        "still being copied.",
        "When the power comes back after an outage, the daemon resumes where it stopped instead of starting "
        "every job again.",
        "People trust tools that behave the same way every night, even when they never look at the logs.",
        "A half-written result is worse than none, so every output is written under a temporary name and "
        "renamed when complete.",
        "Some evenings bring one small note, and others bring a box of scanned minutes from a decade of meetings.",
        "The quiet hours are also when the machine updates itself, so a considerate task yields when the "
        "system needs to restart.",
        "A log written for a tired person at midnight should use short sentences and name the file it is "
        "talking about.",
    ),
}

# A letter page with one-inch margins: 46 lines of 11-point Helvetica at 14-point leading, and 88 characters
# of this prose (measured with the font metrics) fit within its 468-point measure.
_PAGE_LINES = 46
_LINE_CHARS = 88


@dataclass(frozen=True)
class Section:
    heading: str  # "" for a section without a heading
    paragraphs: tuple[str, ...]


@dataclass(frozen=True)
class SampleDocument:
    filename: str
    title: str
    sections: tuple[Section, ...]

    @property
    def paragraphs(self) -> list[str]:
        return [paragraph for section in self.sections for paragraph in section.paragraphs]


def sample_documents() -> list[SampleDocument]:
    """The sample documents' content, the same on every call."""
    topics = list(SENTENCES)
    return [
        SampleDocument("field-note.txt", "Field note", (_section("night-note", "", ["night"], 2, 4),)),
        SampleDocument(
            "waiting-well.md",
            "Waiting Well: Notes on Background Document Work",
            tuple(
                _section(f"essay-{topic}", topic.capitalize(), [topic, following], 5, 5)
                for topic, following in zip(topics, topics[1:] + topics[:1], strict=True)
            ),
        ),
        SampleDocument(
            "battery-budget.html",
            "The Battery Budget",
            (_section("html", "", ["energy"], 3, 5), _section("html-night", "After dark", ["night"], 2, 4)),
        ),
        SampleDocument(
            "paper-archive.pdf",
            "On Keeping Paper",
            (_section("pdf", "", ["archives"], 4, 5), _section("pdf-queues", "Filing by queue", ["queues"], 4, 5)),
        ),
        SampleDocument(
            "expert-committee.docx",
            "The Expert Committee",
            (
                _section("docx", "", ["experts"], 4, 5),
                _section("docx-static", "Static shapes", ["accelerators"], 3, 5),
            ),
        ),
        SampleDocument("night-shift-log.txt", "Night Shift: A Log of Background Work", _night_log(30)),
    ]


def write_samples(directory: Path) -> list[Path]:
    """Write every sample document into `directory` (created if missing); returns their paths in order."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for document in sample_documents():
        path = directory / document.filename
        path.write_bytes(_WRITERS[path.suffix](document))
        paths.append(path)
    return paths


def text_pdf(paragraphs: Sequence[str]) -> bytes:
    """A PDF with the paragraphs set in Helvetica, wrapped and paginated, one blank line between them."""
    lines: list[str] = []
    for paragraph in paragraphs:
        lines += [*textwrap.wrap(paragraph, _LINE_CHARS, break_on_hyphens=False), ""]
    pages = [lines[start : start + _PAGE_LINES] for start in range(0, len(lines), _PAGE_LINES)]
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


def _section(seed: str, heading: str, topics: list[str], paragraphs: int, sentences: int) -> Section:
    """Paragraphs dealt from the topics' sentences like cards: no sentence repeats until all have been used."""
    rng = random.Random(seed)  # str seeds are hashed with SHA-512: the same text on every run and machine
    pool = [sentence for topic in topics for sentence in SENTENCES[topic]]
    deck: list[str] = []
    texts = []
    for _ in range(paragraphs):
        chosen: list[str] = []
        while len(chosen) < sentences:
            if not deck:
                deck = rng.sample(pool, len(pool))
            sentence = deck.pop()
            if sentence not in chosen:  # a fresh deck may deal again what this paragraph already holds
                chosen.append(sentence)
        texts.append(" ".join(chosen))
    return Section(heading, tuple(texts))


def _night_log(nights: int) -> tuple[Section, ...]:
    """Chapters of a night porter's log: one entry with fresh numbers, then three reflective paragraphs."""
    rng = random.Random("night-shift-log")
    topics = list(SENTENCES)
    kinds = ("report", "contract", "thesis", "set of minutes", "manual", "grant proposal")
    sections = []
    for night in range(1, nights + 1):
        waiting = rng.randint(3, 40)
        setaside = rng.randint(0, 2)
        power = rng.choice(("mains power", f"battery at {rng.randint(35, 95)} percent"))
        decision = rng.choice(("started at once", "waited for the overnight window", "waited for the charger"))
        entry = (
            f"Night {night}. At dusk the inbox held {waiting} documents, the largest of them a "
            f"{rng.randint(12, 480)}-page {rng.choice(kinds)}. The machine ran on {power} and the scheduler "
            f"{decision}. By {rng.randint(1, 5)}:{rng.randint(0, 59):02d} the queue was empty, with {setaside} "
            f"document{'' if setaside == 1 else 's'} set aside for a person to look at."
        )
        reflections = [" ".join(rng.sample(SENTENCES[topics[(night + k) % len(topics)]], 6)) for k in range(3)]
        sections.append(Section(f"Night {night}", (entry, *reflections)))
    return tuple(sections)


def _blocks(document: SampleDocument) -> list[str]:
    """Title, headings and paragraphs in reading order, for the formats without markup."""
    blocks = [document.title]
    for section in document.sections:
        blocks += [section.heading] if section.heading else []
        blocks += section.paragraphs
    return blocks


def _plain(document: SampleDocument) -> bytes:
    return ("\n\n".join(_blocks(document)) + "\n").encode()


def _markdown(document: SampleDocument) -> bytes:
    blocks = [f"# {document.title}", "Contents:\n\n" + "\n".join(f"- {s.heading}" for s in document.sections)]
    for section in document.sections:
        blocks += [f"## {section.heading}", *section.paragraphs]
    return ("\n\n".join(blocks) + "\n").encode()


def _html(document: SampleDocument) -> bytes:
    # The script, the style and the entity are there to be handled: none of their markup may reach the text.
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(document.title)}</title>",
        "<style>body { font-family: serif; max-width: 40em; }</style>",
        "<script>document.title = 'scripts are not text';</script>",
        f"</head><body><article><h1>{html.escape(document.title)}</h1>",
    ]
    for section in document.sections:
        if section.heading:
            parts.append(f"<h2>{html.escape(section.heading)}</h2>")
        parts += [f"<p>{html.escape(paragraph)}</p>" for paragraph in section.paragraphs]
    parts.append("<ul><li>Power &amp; patience</li><li>Charger first</li><li>Night second</li></ul>")
    parts.append("</article></body></html>")
    return "\n".join(parts).encode()


def _pdf(document: SampleDocument) -> bytes:
    return text_pdf(_blocks(document))


def _docx(document: SampleDocument) -> bytes:
    import docx  # only this writer needs python-docx

    word = docx.Document()
    word.add_heading(document.title, level=0)
    for section in document.sections:
        if section.heading:
            word.add_heading(section.heading, level=1)
        for paragraph in section.paragraphs:
            word.add_paragraph(paragraph)
    table = word.add_table(rows=0, cols=3)
    for values in (("Group", "Tier", "Runs on"), ("0-7", "64 tokens", "accelerator"), ("8-11", "16 tokens", "CPU")):
        for cell, value in zip(table.add_row().cells, values, strict=True):
            cell.text = value
    out = io.BytesIO()
    word.save(out)
    return _undated_zip(out.getvalue())


def _undated_zip(data: bytes) -> bytes:
    """The same ZIP with every entry dated 1980-01-01, so each write gives the same bytes (and the same sha256)."""
    source = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as target:
        for member in source.infolist():
            target.writestr(zipfile.ZipInfo(member.filename), source.read(member), zipfile.ZIP_DEFLATED)
    return out.getvalue()


def _text_stream(lines: Sequence[str]) -> bytes:
    shown = b"".join(b"(%s) Tj T*\n" % _pdf_string(line) for line in lines)
    return b"BT /F1 11 Tf 14 TL 72 720 Td\n%sET" % shown


def _pdf_string(text: str) -> bytes:
    return text.encode("cp1252").replace(b"\\", b"\\\\").replace(b"(", b"\\(").replace(b")", b"\\)")


_WRITERS: dict[str, Callable[[SampleDocument], bytes]] = {
    ".txt": _plain,
    ".md": _markdown,
    ".html": _html,
    ".pdf": _pdf,
    ".docx": _docx,
}
