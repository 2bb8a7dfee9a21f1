"""Summary prompts and answers (generate/summary.py): how long an answer may be, a part's opening line, an echo of
the instruction, and a PDF's hard-wrapped lines. Thinking models: test_summary_thinking.py."""

from __future__ import annotations

from npumoe.engine.generate.summary import FEWEST, SUMMARIZE, answer_tokens, echoes, joined_lines, opening


def test_a_summary_is_at_most_a_third_of_its_text_but_a_few_sentences_at_least() -> None:
    assert answer_tokens(3000, 128) == 128  # a long text: the configured budget
    assert answer_tokens(192, 128) == 64  # a short one: a third of it, or the summary would be a copy
    assert answer_tokens(60, 128) == FEWEST
    assert answer_tokens(192, 16) == 16  # never more than configured


def test_a_parts_line_is_its_opening_sentences_on_one_line_within_its_length():
    assert opening("Night 3. The queue\nwas empty. Later more.", (4, 10)) == "Night 3. The queue was empty."
    assert opening("The queue was empty. Later", (2, 10)) == "The queue was empty."
    assert opening("The queue was\n\nempty by two", (2, 10)) == "The queue was empty by two"
    assert opening("one two three four. five", (2, 3)) == "one two three …"


def test_an_answer_that_only_says_the_instruction_back_is_an_echo():
    assert echoes("A summary of text above in plain English.", SUMMARIZE)
    assert echoes("The text above is a summary of the text in plain English.", SUMMARIZE)
    assert not echoes("A job that has failed too many times is set aside, not retried forever.", SUMMARIZE)
    assert not echoes("", SUMMARIZE)


def test_a_pdfs_hard_wrapped_lines_are_joined_but_paragraphs_and_lists_keep_theirs() -> None:
    assert joined_lines("A job that\nfailed.\n\n- one\n- two") == "A job that failed.\n\n- one\n- two"
