"""Query words, a chunk widened to whole sentences, and the passage shown for a hit."""

from __future__ import annotations

from npumoe.engine.generate.sentences import sentence_spans
from npumoe.jobs.search.passages import passage, passage_spans, query_terms, widened_to_sentences

TEXT = ("The tide came in at dusk. Boats rocked at their moorings!\n\nA gull watched the harbour wall. "
        "Nobody counted the ropes? The night was long and quiet.")


def test_query_terms_are_distinct_case_folded_words_without_punctuation() -> None:
    assert query_terms("The tide, THE tide... and snake_case 42!") == ["the", "tide", "and", "snake", "case", "42"]


def test_a_span_widens_to_the_whole_sentences_it_touches() -> None:
    start = TEXT.index("rocked")
    a, b = widened_to_sentences(sentence_spans(TEXT), start, TEXT.index("watched"))
    assert TEXT[a:b] == "Boats rocked at their moorings!\n\nA gull watched the harbour wall."


def test_the_passage_starts_at_the_sentence_with_most_query_words_and_grows_to_whole_sentences() -> None:
    chunk = (TEXT.index("gull"), TEXT.index("ropes"))  # an edge in the middle of two sentences
    shown = passage(TEXT, *chunk, query_terms("counted ropes"), limit=60)
    assert shown.text == "Nobody counted the ropes? The night was long and quiet."
    assert TEXT[shown.start:shown.end].startswith("Nobody")


def test_a_passage_stays_within_the_limit_unless_one_sentence_is_longer() -> None:
    short = passage(TEXT, 0, len(TEXT), query_terms("gull"), limit=10)
    assert short.text == "A gull watched the harbour wall."
    wide = passage(TEXT, 0, len(TEXT), query_terms("gull"), limit=1000)
    assert wide.text == " ".join(TEXT.split())


def test_a_passage_reaches_at_most_one_sentence_past_the_chunk() -> None:
    chunk = (0, TEXT.index("Boats") - 1)  # the first sentence only
    shown = passage(TEXT, *chunk, query_terms("tide quiet"), limit=1000)
    assert shown.text == "The tide came in at dusk. Boats rocked at their moorings!"


def test_passages_are_runs_of_whole_sentences_of_at_most_the_word_budget_covering_the_text() -> None:
    spans = passage_spans(TEXT, words=12)
    assert [TEXT[a:b] for a, b in spans] == [
        "The tide came in at dusk. Boats rocked at their moorings!",
        "A gull watched the harbour wall. Nobody counted the ropes?",
        "The night was long and quiet."]
    assert passage_spans("One two three four five six.", words=3) == [(0, 28)]  # a longer sentence stands alone
