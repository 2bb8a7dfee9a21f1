"""`summary.md`: the format of a document's summary file, written and read here only.

Three blocks, each after a blank line:

    # <the document's name, on one line>

    _model `<model>` · <n> chunks · <n> tokens_

    <the summary, as the model wrote it>

The search index keeps the summary's first line (`SummaryFile.first_line`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .outputs import SUMMARY_FILE, readable

FACTS_SEPARATOR = " · "


@dataclass(frozen=True)
class SummaryFile:
    title: str  # the document's name
    facts: tuple[str, ...]  # what made the summary: the model, how many chunks and tokens it read
    text: str  # the summary itself

    @property
    def first_line(self) -> str:
        lines = self.text.splitlines()
        return lines[0] if lines else ""


def render_summary(name: str, model: str, chunks: int, tokens: int, summary: str) -> str:
    """The summary file of document `name`. Every block is kept to one line but the summary, so that a hostile file
    name (or a model path holding a newline) cannot move the blocks `parse_summary` finds."""
    facts = [f"model `{_one_line(model)}`", f"{chunks} chunks", f"{tokens} tokens"]
    return f"# {_one_line(readable(name))}\n\n_{FACTS_SEPARATOR.join(facts)}_\n\n{summary.strip()}\n"


def parse_summary(markdown: str) -> SummaryFile:
    """The blocks of a summary file; a block it lacks (a file cut short, or not written here) reads as empty."""
    heading, facts, text = ([*markdown.split("\n\n", 2), "", ""])[:3]
    title = heading.strip().removeprefix("# ")
    facts = facts.strip().removeprefix("_").removesuffix("_")
    return SummaryFile(title, tuple(facts.split(FACTS_SEPARATOR)) if facts else (), text.strip())


def read_summary(folder: Path) -> SummaryFile:
    """The summary file of the output folder `folder` (OSError when it cannot be read)."""
    return parse_summary((folder / SUMMARY_FILE).read_text())


def _one_line(text: str) -> str:
    return " ".join(text.split())
