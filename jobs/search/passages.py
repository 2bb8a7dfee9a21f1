"""The words of a query, and the passage of a chunk worth showing for it.

Chunks are cut at token counts, so their edges fall inside sentences. The index takes a chunk's words
from its whole sentences (`widened_to_sentences`), so a sentence that crosses an edge belongs whole to both
chunks. A chunk is too long to print for every hit: the passage shown is the run of whole sentences
around the chunk that holds the most of the query's words, so text copied from a document comes back entire.
What a sentence is, the engine's summaries and these passages take from one place (generate/sentences.py).
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

from npumoe.engine.generate.sentences import sentence_spans

PASSAGE_WORDS = 200  # what the search model embeds at once: about its 256 tokens, a paragraph or two
MAX_TERMS = 32  # a pasted paragraph is searched by its first words; FTS5 and the weighting stay cheap
PASSAGE_CHARS = 400  # about four lines of a terminal
_WORD = re.compile(r"[^\W_]+")  # letters and digits: what SQLite FTS5's unicode61 tokenizer calls a token


def query_terms(query: str) -> list[str]:
    """The query's distinct words, case-folded, in order, at most MAX_TERMS."""
    return list(dict.fromkeys(_WORD.findall(query.casefold())))[:MAX_TERMS]


def passage_spans(text: str, words: int = PASSAGE_WORDS) -> list[tuple[int, int]]:
    """[start, end) of runs of whole sentences of about `words` words each, covering the text in order: a run ends
    before the sentence that would take it past `words` (a longer sentence is a run of its own)."""
    spans: list[tuple[int, int]] = []
    count = 0
    for a, b in sentence_spans(text):
        n = len(text[a:b].split())
        if spans and count + n <= words:
            spans[-1] = (spans[-1][0], b)
            count += n
        else:
            spans.append((a, b))
            count = n
    return spans


def widened_to_sentences(sentences: list[tuple[int, int]], start: int, end: int) -> tuple[int, int]:
    """[start, end) widened to the whole sentences it touches (`sentences` from `sentence_spans`)."""
    first, last = _overlapping(sentences, start, end)
    return (min(start, sentences[first][0]), max(end, sentences[last - 1][1])) if first < last else (start, end)


@dataclass(frozen=True)
class Passage:
    start: int  # character offsets in the document's text
    end: int
    text: str  # whitespace collapsed to single spaces, for printing


def passage(text: str, start: int, end: int, terms: list[str], limit: int = PASSAGE_CHARS) -> Passage:
    """The best run of whole sentences around text[start:end] for `terms`: it starts from the chunk's sentence
    holding the most of them and grows towards the neighbour holding more (reaching at most one sentence past
    each edge of the chunk) while it stays within about `limit` characters."""
    sentences = sentence_spans(text)
    first, last = _overlapping(sentences, start, end)
    if first == last:  # only whitespace in this span
        return Passage(start, end, " ".join(text[start:end].split()))
    low, high = max(first - 1, 0), min(last + 1, len(sentences))  # how far it may grow
    counts = {i: _count_terms(text[a:b], terms) for i, (a, b) in enumerate(sentences[low:high], low)}
    top = max(range(first, last), key=lambda i: (counts[i], -i))
    lo, hi = top, top + 1  # the run is sentences[lo:hi]
    while True:
        before = counts[lo - 1] if lo > low else -1
        after = counts[hi] if hi < high else -1
        if max(before, after) < 0:
            break
        grown = (lo, hi + 1) if after >= before else (lo - 1, hi)
        if sentences[grown[1] - 1][1] - sentences[grown[0]][0] > limit:
            break
        lo, hi = grown
    a, b = sentences[lo][0], sentences[hi - 1][1]
    return Passage(a, b, " ".join(text[a:b].split()))


def _overlapping(sentences: list[tuple[int, int]], start: int, end: int) -> tuple[int, int]:
    """Indexes [first, last) of the sentences that overlap [start, end)."""
    first = bisect.bisect_right([b for _, b in sentences], start)
    last = bisect.bisect_left([a for a, _ in sentences], max(end, start + 1))
    return first, max(first, last)


def _count_terms(sentence: str, terms: list[str]) -> int:
    words = set(_WORD.findall(sentence.casefold()))
    return sum(term in words for term in terms)
