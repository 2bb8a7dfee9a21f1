"""What a sentence is: where one ends, where a cut text's first one begins, and a text cut mid-sentence."""

from __future__ import annotations

from npumoe.engine.generate.sentences import finished_sentences, from_first_sentence, sentence_spans

TEXT = ("The tide came in at dusk. Boats rocked at their moorings!\n\nA gull watched the harbour wall. "
        "Nobody counted the ropes? The night was long and quiet.")


def test_sentences_end_at_stops_and_blank_lines_without_trailing_space() -> None:
    assert [TEXT[a:b] for a, b in sentence_spans(TEXT)] == [
        "The tide came in at dusk.", "Boats rocked at their moorings!", "A gull watched the harbour wall.",
        "Nobody counted the ropes?", "The night was long and quiet."]


def test_a_stop_ends_a_sentence_only_before_whitespace_and_takes_the_closing_quotes_with_it() -> None:
    text = 'Pi is 3.14 or so. She said "go." (Then she went.) Heading\n\nBody'
    assert [text[a:b] for a, b in sentence_spans(text)] == [
        "Pi is 3.14 or so.", 'She said "go."', "(Then she went.)", "Heading", "Body"]


def test_a_text_cut_mid_sentence_keeps_its_finished_sentences() -> None:
    assert finished_sentences(" The queue was empty. The worker then ") == "The queue was empty."
    assert finished_sentences('It said "done." And') == 'It said "done."'


def test_a_text_that_ends_with_a_stop_or_holds_none_stays_as_it_is() -> None:
    assert finished_sentences("The queue was empty. It waited.\n") == "The queue was empty. It waited."
    assert finished_sentences("the queue was") == "the queue was"
    # a blank line ends a heading, but does not finish a sentence: the summary is not cut back to its heading
    assert finished_sentences("Summary\n\nThe queue was") == "Summary\n\nThe queue was"


def test_a_text_cut_from_a_longer_one_is_read_from_its_first_sentence_that_begins_as_one() -> None:
    assert from_first_sentence("of the harbour. The tide came in.") == "The tide came in."
    assert from_first_sentence("wall.\n\n“Ropes,” he said.") == "“Ropes,” he said."
    assert from_first_sentence("Boats rocked. Gulls") == "Boats rocked. Gulls"  # begins as a sentence does
    assert from_first_sentence("all lower case. and more") == "all lower case. and more"  # none does: all of it
