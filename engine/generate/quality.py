"""The check every text the model writes passes before anyone reads it, and the summary that replaces one that fails.

A small model's answer can say its instruction back, trail off into lines of a word or two ("A"), loop, make claims
its source never makes, or answer in another language than the document. `fault` names the first such fault of an
answer (None: it may stand); `extractive` is the fallback that has none of them by construction: the source's own
most central sentences, those that share the most words with the rest of it.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from .sentences import from_first_sentence, sentence_spans

# The faults, in the order they are looked for: the first found is the one reported.
ECHO, SHORT_LINE, LOOP, LANGUAGE, UNSUPPORTED = "echo", "short_line", "loop", "language", "unsupported"
FAULTS = (ECHO, SHORT_LINE, LOOP, LANGUAGE, UNSUPPORTED)
# How a text that was checked came to be: the model's first answer passed, its second (asked another way) did, or
# neither did and the source's own sentences stand in for them.
FIRST, RETRY, EXTRACTIVE = "first", "retry", "extractive"
SECTION, COMBINED = "section", "combine"  # what a checked text is: a section's summary, or a combine of summaries

STEM = 5  # letters a word is known by, so "summary" is "Summarize" and "failed" is "failure"
ECHO_SHARE = 0.8  # of an answer's words being the instruction's: it says nothing of its own
ECHO_RUN = 4  # words in a row taken from the instruction (and not from the source): it is quoting the prompt
FEWEST_WORDS = 3  # in a line: fewer is a fragment ("A", "A good summary"), not something a reader can use
LOOP_RUN = 5  # words: the same five words twice in one answer is a loop
# Of an answer's content words, the share that are distinct, at least, once it has this many: the demo's combine
# wrote "A report is a good report, and a report is a bad report. A summary is a good summary..." (0.44 of 25),
# where its summaries a reader can use measured 0.67 to 1.0.
LOOP_VARIETY, LOOP_VARIETY_WORDS = 0.5, 20
SUPPORTED = 0.5  # of a sentence's content words that its source holds, at least
CLAIM_WORDS = 3  # content words a sentence needs before it counts as a claim to check
LANGUAGE_WORDS = 5  # function words a text needs before its language is judged
UNSPACED = frozenset({"cjk", "hiragana", "katakana", "thai", "lao", "khmer", "myanmar"})  # scripts written unspaced

_WORD = re.compile(r"\w+")
_LETTERS = re.compile(r"[^\W\d_]{3,}")
# Function words, too common to say what a text is about; the short lists below also tell languages apart.
# (A word list reads better as text, hence the noqa.)
_COMMON = frozenset("""the and for with from that this these those there their they them his her its our your you
are was were been being have has had not but can could will would should may might must does did done into over under
about after before between through during while also only more most less very some such each every than then when
where which what who whom how why all any one two three other same just text document part summary""".split())  # noqa: SIM905
_FUNCTION_WORDS: dict[str, frozenset[str]] = {  # the commonest words of each language
    name: frozenset(words.split()) for name, words in {
        "en": "the and of to is in that it was for on are with as be this by not from at or have an which",
        "fr": "le la les et de des est un une que qui dans pour pas sur au aux du ce il elle sont avec ne se",
        "de": "der die das und ist nicht ein eine zu den mit sich auf dem des auch es für von sie im",
        "es": "el la los las y es que en un una por con para del se al no su lo como más",
        "it": "il la che di e è un una per non sono con del della le gli si al nel anche",
        "nl": "de het een en van is dat niet op te zijn voor met als ook aan er maar om",
        "pt": "o a os as e de que em um uma para com não do da se por mais na no",
    }.items()
}


@dataclass(frozen=True)
class Fault:
    kind: str  # one of FAULTS
    detail: str  # what in the answer showed it, for meta.json and the log


@dataclass(frozen=True)
class CheckedText:
    """How one text the model wrote passed the check: its first answer, its retry, or neither (the source's own
    sentences stand in for them), and the faults its answers had."""

    kind: str  # SECTION or COMBINED
    path: str  # FIRST, RETRY or EXTRACTIVE
    faults: tuple[Fault, ...]  # the first answer's fault, then the retry's; empty when the first passed


def fault(answer: str, source: str, instruction: str) -> Fault | None:
    """The first fault of `answer`, the model's reply to `instruction` about `source`; None when it has none."""
    for check in (_echo, _short_line, _loop, _language, _unsupported):
        found = check(answer, source, instruction)
        if found is not None:
            return found
    return None


def extractive(source: str, fits: Callable[[str], bool]) -> str:
    """`source`'s most central sentences, as many as `fits` allows (at least one, cut to fit with an ellipsis),
    in the source's order on one line. A sentence is central by the content words it shares with the others; one
    that would repeat five words of those already chosen (a log's lines that differ by a time) is left out."""
    sentences = _prose(from_first_sentence(source))  # a section may begin mid-sentence
    stems = [set(_stems(s)) for s in sentences]
    centrality = [sum(len(mine & theirs) / (1 + len(mine | theirs)) for j, theirs in enumerate(stems) if j != i)
                  for i, mine in enumerate(stems)]
    chosen: list[int] = []
    for i in sorted(range(len(sentences)), key=lambda i: -centrality[i]):
        said = _in_order(sentences, [*chosen, i])
        if not chosen or (fits(said) and _loop(said, source, "") is None):
            chosen.append(i)
    said = _in_order(sentences, chosen)
    words = said.split()
    while len(words) > 1 and not fits(said):
        words = words[:-1]
        said = " ".join(words) + " …"
    return said


def _prose(text: str) -> list[str]:
    """The sentences of `text` (each line of it on its own: a heading or a list item ends at its line) that read
    as sentences: finished by a stop and of at least LOOP_RUN words; every piece of it when none does."""
    pieces = list(dict.fromkeys(" ".join(line[a:b].split()) for line in text.splitlines()
                                for a, b in sentence_spans(line)))
    prose = [p for p in pieces if p[-1] in ".!?" and len(_WORD.findall(p)) >= LOOP_RUN]
    return prose or pieces or [" ".join(text.split())]


def _in_order(sentences: list[str], chosen: list[int]) -> str:
    return " ".join(sentences[i] for i in sorted(chosen))


def _echo(answer: str, source: str, instruction: str) -> Fault | None:
    words = [w[:STEM] for w in _LETTERS.findall(answer.lower())]
    asked = set(_stems(instruction, common=True))
    if words and sum(w in asked for w in words) >= ECHO_SHARE * len(words):
        return Fault(ECHO, "nearly every word is the instruction's")
    quoted = _runs(instruction, ECHO_RUN) & _runs(answer, ECHO_RUN) - _runs(source, ECHO_RUN)
    if quoted:
        return Fault(ECHO, f"quotes the instruction: {' '.join(min(quoted))!r}")
    return None


def _short_line(answer: str, source: str, instruction: str) -> Fault | None:
    lines = [line.strip() for line in answer.splitlines() if line.strip()]
    if not lines:
        return Fault(SHORT_LINE, "empty")
    short = [line for line in lines if _words(line) < FEWEST_WORDS]
    return Fault(SHORT_LINE, f"line {short[0]!r}") if short else None


def _loop(answer: str, source: str, instruction: str) -> Fault | None:
    sentences = [" ".join(_WORD.findall(answer[a:b].lower())) for a, b in sentence_spans(answer)]
    said_twice = [s for s, n in Counter(s for s in sentences if s).items() if n > 1]
    if said_twice:
        return Fault(LOOP, f"says {said_twice[0]!r} twice")
    words = _WORD.findall(answer.lower())
    runs = Counter(zip(*(words[i:] for i in range(LOOP_RUN)), strict=False))
    repeated = [run for run, n in runs.items() if n > 1]
    if repeated:
        return Fault(LOOP, f"says {' '.join(repeated[0])!r} twice")
    stems = _stems(answer)
    if len(stems) >= LOOP_VARIETY_WORDS and len(set(stems)) < LOOP_VARIETY * len(stems):
        return Fault(LOOP, f"turns over a few words: {len(set(stems))} distinct of {len(stems)}")
    return None


def _unsupported(answer: str, source: str, instruction: str) -> Fault | None:
    if language(source) in UNSPACED:
        return None  # words are not told apart by spaces there: no content words to compare
    known = set(_stems(source))
    for a, b in sentence_spans(answer):
        claimed = _stems(answer[a:b])
        if len(claimed) >= CLAIM_WORDS and sum(w in known for w in claimed) < SUPPORTED * len(claimed):
            return Fault(UNSUPPORTED, f"most of {answer[a:b]!r} is not in the source")
    return None


def _language(answer: str, source: str, instruction: str) -> Fault | None:
    written, expected = language(answer), language(source)
    if written is None or expected is None or written == expected:
        return None
    return Fault(LANGUAGE, f"written in {written}, the source in {expected}")


def language(text: str) -> str | None:
    """The language (ISO 639-1) or script a text is written in, judged by its letters' script and, for Latin
    letters, by the function words it uses; None when it holds too few to say."""
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return None
    scripts = Counter(unicodedata.name(c, "UNKNOWN").split()[0] for c in letters)
    script, count = scripts.most_common(1)[0]
    if script != "LATIN":
        return script.lower() if count >= len(letters) / 2 else None
    words = _WORD.findall(text.lower())
    votes = Counter({name: sum(w in common for w in words) for name, common in _FUNCTION_WORDS.items()})
    (best, hits), *rest = votes.most_common()
    if hits < LANGUAGE_WORDS or (rest and rest[0][1] * 2 > hits):  # too few, or no clear winner
        return None
    return best


def _words(line: str) -> int:
    """Words in `line`; in a script written without spaces, its letters (a word there is one to a few)."""
    if language(line) in UNSPACED:
        return sum(c.isalpha() for c in line)
    return len(_WORD.findall(line))


def _stems(text: str, *, common: bool = False) -> list[str]:
    """The content words of `text` (all its words with `common`), each by its first STEM letters."""
    words = _LETTERS.findall(text.lower())
    return [w[:STEM] for w in words if common or (len(w) > 3 and w not in _COMMON)]


def _runs(text: str, n: int) -> set[tuple[str, ...]]:
    words = _LETTERS.findall(text.lower())
    return set(zip(*(words[i:] for i in range(n)), strict=False))
