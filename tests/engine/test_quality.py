"""The check on every text the model writes (generate/quality.py): each fault it names, what it lets through, the
language it reads a text as, and the extractive summary that stands in for an answer that fails twice."""

from __future__ import annotations

from pathlib import Path

import pytest

from npumoe.engine.generate.quality import (
    ECHO,
    LANGUAGE,
    LOOP,
    SHORT_LINE,
    UNSUPPORTED,
    Fault,
    extractive,
    fault,
    language,
)
from npumoe.engine.generate.summary import COMBINE, SUMMARIZE

LOG = """Night Shift: A Log of Background Work

At dusk the inbox held 24 documents, the largest of them a 411-page set of minutes.
By 2:14 the queue was empty, with 0 documents set aside for a person to look at.
By 5:04 the queue was empty, with 0 documents set aside for a person to look at.
A job that has failed too many times is set aside with its last error written next to it, not retried forever.
The cheapest computation is the one postponed until the charger is connected.
The queue waits for the charger before it starts the largest documents of the night."""

GOOD = "The log follows a night of background work: the queue emptied by morning and no document was set aside."

# What the demo model wrote for the long sample before this check (issue 45): the combine's instruction said back,
# then lines of one letter.
ISSUE_45 = ("A summary of one part of a long document is a clear and concise description of the content. A good "
            "summary keeps paragraphs apart from the text.\n\nA good summary keeps both\n\nA\n\nA")


def test_a_faithful_answer_in_the_documents_language_passes() -> None:
    assert fault(GOOD, LOG, SUMMARIZE) is None


@pytest.mark.parametrize(("answer", "kind"), [
    ("A summary of the text above in plain English.", ECHO),  # nearly every word is the instruction's
    (ISSUE_45, ECHO),  # quotes the combine's instruction: "one part of a long document"
    ("The queue was empty by morning.\n\nA\n\nA", SHORT_LINE),
    ("", SHORT_LINE),
    ("The queue was empty by morning. The queue was empty by morning.", LOOP),
    ("The queue held the minutes, and the queue held the minutes of the night.", LOOP),  # five words twice
    ("Le journal décrit une nuit de travail: la file était vide le matin et aucun document "
     "n'a été mis de côté pour une personne.", LANGUAGE),
    ("A magician shuffled a stack of cards on the table and pulled the ace of spades.", UNSUPPORTED),
])
def test_each_fault_is_named(answer: str, kind: str) -> None:
    found = fault(answer, LOG, f"{SUMMARIZE} {COMBINE}")
    assert found is not None and found.kind == kind, found


def test_words_quoted_from_the_source_are_no_echo_even_when_the_instruction_has_them() -> None:
    source = "Each part of a long document is read in order by the queue before the charger is connected."
    assert fault("Each part of a long document is read in order by the queue.", source, COMBINE) is None


def test_an_answer_in_an_unspaced_script_is_not_judged_by_words_it_cannot_tell_apart() -> None:
    source = "夜のキューは朝までに空になりました。充電器がつながるまで大きな文書は待ちました。"
    assert fault("キューは朝までに空になり、大きな文書は充電を待ちました。", source, SUMMARIZE) is None
    assert fault("キューは朝までに空になりました。\n\nはい", source, SUMMARIZE) == Fault(SHORT_LINE, "line 'はい'")


def test_a_text_is_read_as_the_language_its_common_words_and_letters_say() -> None:
    assert language(LOG) == "en"
    assert language("Der Bericht ist nicht fertig, und die Warteschlange ist leer, weil sie auf den Strom wartet "
                    "und sich mit dem Netz verbindet.") == "de"
    assert language("夜のキューは朝までに空になりました。") in {"cjk", "hiragana"}
    assert language("Queue empty.") is None  # too few words to say


def test_the_extractive_summary_is_the_most_central_sentences_in_order_within_the_budget() -> None:
    said = extractive(LOG, lambda s: len(s.split()) <= 40)
    assert len(said.split()) <= 40
    sentences = [line for line in LOG.splitlines() if line and line in said]
    assert said == " ".join(sentences)  # whole sentences of the source, in its order
    assert "The queue waits for the charger" in said  # shares the most words with the rest
    assert not ("By 2:14" in said and "By 5:04" in said)  # never two lines that differ by a time
    assert "Night Shift: A Log" not in said  # a heading is no sentence
    assert fault(said, LOG, SUMMARIZE) is None


def test_an_extractive_summary_longer_than_the_budget_is_cut_with_an_ellipsis() -> None:
    said = extractive("A single long sentence about the queue and the charger and the night of work.",
                      lambda s: len(s.split()) <= 6)
    assert said == "A single long sentence about …"


def test_an_answer_that_turns_a_few_of_the_sources_words_over_and_over_is_a_loop():
    # What the demo's combine wrote for the night-shift log: every word is the document's, no sentence is repeated
    source = (Path(__file__).parents[2] / "daemon" / "samples" / "night-shift-log.txt").read_text()
    answer = ("The best schedule keeps both the processor and the accelerator busy at the same time, each with the "
              "work it does best. A report that is not only a good summary but also a good one is a good one. A report "
              "is a good report, and a report is a bad report. A report should be a good report. A summary is a good "
              "summary, and a good one should be a bad one. A summary should be a very good summary, but a very bad "
              "one.")
    found = fault(answer, source, COMBINE)
    assert found is not None and found.kind == LOOP and "distinct" in found.detail, found
