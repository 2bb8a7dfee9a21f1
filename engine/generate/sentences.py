"""What a sentence is, said once: for the summaries written here and for the passages search shows.

A sentence ends at a stop: `.`, `!` or `?`, with any closing quotes or brackets after it, where
whitespace or the end of the text follows (so "3.14" and "e.g.x" go on). A blank line ends one too:
a heading, a list item or a paragraph left without a stop is a sentence of its own.
"""

from __future__ import annotations

import itertools
import re

# "stop" is a finished sentence's end; the other alternative is a blank line between paragraphs.
_SENTENCE_END = re.compile(r"(?P<stop>[.!?][\"'”’)\]]*)(?=\s|\Z)|\n\s*\n")
_OPENS_A_SENTENCE = "\"'“‘"  # besides a capital letter or a digit


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of each sentence of `text`, in order, without the whitespace around them."""
    bounds = [0, *(m.end() for m in _SENTENCE_END.finditer(text)), len(text)]
    spans = []
    for a, b in itertools.pairwise(bounds):
        piece = text[a:b]
        start = a + len(piece) - len(piece.lstrip())
        end = a + len(piece.rstrip())
        if end > start:
            spans.append((start, end))
    return spans


def stop_ends(text: str) -> list[int]:
    """Where each finished sentence of `text` ends (after its stop), in order; a blank line finishes none."""
    return [m.end() for m in _SENTENCE_END.finditer(text) if m["stop"]]


def finished_sentences(text: str) -> str:
    """`text`, stripped, up to the end of its last finished sentence: what is left when a token budget cut it
    mid-sentence. As it is when it ends with a stop or holds none."""
    text = text.strip()
    ends = stop_ends(text)
    return text[:ends[-1]] if ends else text


def from_first_sentence(text: str) -> str:
    """`text` from the first sentence that begins as one does (a capital, a digit, an opening quote): a piece cut
    from a longer text may begin mid-sentence. All of it when no sentence begins so."""
    for start, _ in sentence_spans(text):
        first = text[start]
        if first.isupper() or first.isdigit() or first in _OPENS_A_SENTENCE:
            return text[start:]
    return text
