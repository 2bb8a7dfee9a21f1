"""The summarizer (generate/summarizer.py): each section's summary decoded from its chunk-prefilled cache, the
sections' summaries combined, and the room the prompts leave in the model's context."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import numpy as np
import pytest
import torch

from npumoe.engine import Engine, load_model
from npumoe.engine.generate import summarizer as summarizer_module
from npumoe.engine.generate.quality import (
    COMBINED,
    ECHO,
    EXTRACTIVE,
    FIRST,
    LANGUAGE,
    LOOP,
    RETRY,
    SECTION,
    SHORT_LINE,
    UNSUPPORTED,
)
from npumoe.engine.generate.section_cache import PreallocatedLayer
from npumoe.engine.generate.sentences import finished_sentences
from npumoe.engine.generate.summarizer import SummaryPrompts
from npumoe.engine.generate.summary import (
    COMBINE,
    COMBINE_AGAIN,
    NO_REPEAT,
    NO_REPEAT_AGAIN,
    OUTLINE_HEADING,
    OUTLINE_WORDS,
    SUMMARIZE,
    SUMMARIZE_AGAIN,
    NoRepeatInAnswer,
    PromptFrame,
    joined_lines,
    opening,
    stop_ids,
    text_tokens,
)
from npumoe.jobs.meta import SummaryCheck


def test_the_summary_is_what_greedy_generation_on_the_whole_prompt_gives(engine, reference, orchard, unchecked):
    text = orchard[:700]
    result = engine.process(text)
    assert result.summary == greedy_summary(reference, text, engine.settings.summary_tokens)
    assert result.summary  # the random model does say something


def greedy_summary(loaded, text: str, summary_tokens: int) -> str:
    """What `generate` says, greedily and without repeating the answer's n-grams, after the whole summary prompt in
    one forward, up to its last finished sentence."""
    frame = PromptFrame.build(loaded.tokenizer, SUMMARIZE)
    prompt = torch.tensor([frame.prefix + list(text.encode()) + frame.suffix])
    stop = stop_ids(loaded.model, loaded.tokenizer)
    with torch.no_grad():
        out = loaded.model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                    max_new_tokens=summary_tokens, eos_token_id=stop, pad_token_id=stop[0],
                                    logits_processor=[NoRepeatInAnswer(prompt.shape[1], NO_REPEAT)])
    return finished_sentences(joined_lines(loaded.tokenizer.decode(out[0, prompt.shape[1]:],
                                                                   skip_special_tokens=True)))


@pytest.mark.parametrize("arch", ["qwen3_next", "nemotron_h", "lfm2_moe", "gpt_oss"])
def test_models_whose_cache_is_more_than_attention_prefill_in_chunks_into_their_own_cache(engine, tiny, orchard, arch,
                                                                                         unchecked):
    """Linear attention (Qwen3-Next), Mamba (Nemotron-H), short convolutions (LFM2) and sliding windows (gpt-oss)
    keep state the chunks must carry: the summary decoded from the chunk-prefilled cache is what greedy
    generation on the whole prompt gives."""
    folder = str(tiny(arch))
    other = Engine.load(replace(engine.settings, model=folder))
    text = orchard[:700]
    result = other.process(text)
    assert result.stats.chunks > 1
    assert result.summary == greedy_summary(load_model(folder), text, engine.settings.summary_tokens)
    assert result.summary


def test_a_document_longer_than_the_context_is_summarised_in_sections_then_combined(engine, harbour, orchard):
    text = harbour + "\n\n" + orchard
    seen = []
    result = engine.process(text, on_progress=seen.append)
    stats = result.stats
    assert stats.tokens == len(text.encode()) > engine.loaded.context_tokens  # nothing truncated
    assert stats.sections == math.ceil(stats.tokens / engine.section_tokens) >= 2
    assert stats.reduce_rounds >= 1
    assert {p.phase for p in seen} == {"prefill", "summary", "reduce"}
    assert result.embeddings.shape[0] == stats.chunks + 1
    assert max(p.tokens_done for p in seen) == stats.tokens


def test_every_section_and_combine_decodes_into_a_cache_made_once_at_its_size(engine, harbour, orchard,
                                                                             monkeypatch):
    made: list[PreallocatedLayer] = []
    grown = []
    lazy, grow = PreallocatedLayer.lazy_initialization, PreallocatedLayer._grow
    monkeypatch.setattr(PreallocatedLayer, "lazy_initialization",
                        lambda self, *a: made.append(self) or lazy(self, *a))
    monkeypatch.setattr(PreallocatedLayer, "_grow", lambda self, needed: grown.append(needed) or grow(self, needed))
    result = engine.process(harbour + "\n\n" + orchard)
    caches = result.stats.sections + result.stats.reduce_rounds  # one combine a round here
    assert len(made) == caches * engine.loaded.model.config.num_hidden_layers
    assert grown == []  # each was made large enough for its prompt, text and answer


def test_a_combined_summary_ends_with_each_combined_parts_opening_one_line_each(engine, harbour, orchard,
                                                                                monkeypatch, unchecked):
    answers: list[list[int]] = []
    prompts: list[list[int]] = []
    decode = summarizer_module.decode_from_cache
    monkeypatch.setattr(summarizer_module, "decode_from_cache",
                        lambda model, prompt, *a: prompts.append(prompt) or answers.append(decode(model, prompt, *a))
                        or answers[-1])
    result = engine.process(harbour + "\n\n" + orchard)
    sections = result.stats.sections
    assert result.stats.reduce_rounds == 1 and len(answers) == sections + 1  # the sections', then one combine
    overview, _, lines = result.summary.partition(f"\n\n{OUTLINE_HEADING}\n")
    tokenizer = engine.loaded.tokenizer
    parts = [joined_lines(tokenizer.decode(a, skip_special_tokens=True)) for a in answers[:sections]]
    assert lines.split("\n") == [f"{i}. {opening(p, OUTLINE_WORDS)}" for i, p in enumerate(parts, 1)
                                 if p.strip()]
    assert overview == finished_sentences(joined_lines(tokenizer.decode(answers[-1], skip_special_tokens=True)))
    combine_input = tokenizer.decode(prompts[-1])  # each section's summary after its label, in order
    labelled = [combine_input.find(f"Part {i}: {tokenizer.decode(a)}") for i, a in enumerate(answers[:sections], 1)]
    assert -1 not in labelled and labelled == sorted(labelled)


# Answers with each fault the check looks for, about the harbour text's opening (harbour[:300]), and one without.
FAULTY = {
    ECHO: "A summary of the text above in plain English.",
    SHORT_LINE: "The boats leave the quay before the sun.\n\nA\n\nA",
    LOOP: "The boats leave the stone quay. The boats leave the stone quay.",
    LANGUAGE: "La ville du port se réveille avant le soleil et les bateaux de pêche quittent le quai de pierre.",
    UNSUPPORTED: "A magician shuffled a stack of cards on the table and pulled out the ace of spades.",
}
FAITHFUL = "The harbour town wakes before the sun, and the fishing boats leave the stone quay for the horizon."


class Scripted:
    """Stands in for decoding: answers in turn from `answers`, and notes each prompt and no-repeat it was given."""

    def __init__(self, tokenizer, answers: list[str]) -> None:
        self.tokenizer, self.answers = tokenizer, list(answers)
        self.asked: list[tuple[str, int]] = []  # (the prompt as text, no_repeat)

    def __call__(self, model, prompt, cache, max_new_tokens, stop, no_repeat) -> list[int]:
        self.asked.append((self.tokenizer.decode(prompt), no_repeat))
        return text_tokens(self.tokenizer, self.answers.pop(0))


@pytest.fixture
def extracted(monkeypatch) -> list[str]:
    """Each extractive summary the summarizer made, in order."""
    made: list[str] = []
    extract = summarizer_module.extractive
    monkeypatch.setattr(summarizer_module, "extractive", lambda *a: made.append(extract(*a)) or made[-1])
    return made


@pytest.mark.parametrize("kind", list(FAULTY))
def test_an_answer_that_fails_the_check_is_asked_again_another_way_and_the_retry_recorded(
        engine, harbour, monkeypatch, extracted, kind):
    decode = Scripted(engine.loaded.tokenizer, [FAULTY[kind], FAITHFUL])
    monkeypatch.setattr(summarizer_module, "decode_from_cache", decode)
    result = engine.process(harbour[:300])
    (first, first_no_repeat), (again, again_no_repeat) = decode.asked
    assert SUMMARIZE in first and first_no_repeat == NO_REPEAT
    assert SUMMARIZE_AGAIN in again and SUMMARIZE not in again and again_no_repeat == NO_REPEAT_AGAIN
    assert first.rpartition(SUMMARIZE)[0] == again.rpartition(SUMMARIZE_AGAIN)[0]  # the same text, then the other
    assert extracted == [] and result.summary == FAITHFUL
    (checked,) = result.stats.quality
    assert (checked.kind, checked.path, [f.kind for f in checked.faults]) == (SECTION, RETRY, [kind])
    meta = SummaryCheck.of(result.stats.quality)
    assert (meta.texts, meta.first, meta.retried, meta.extractive) == (1, 0, 1, 0)
    assert meta.faults == {**dict.fromkeys(FAULTY, 0), kind: 1}
    assert meta.why.startswith(f"section 1: {kind} (") and meta.why.endswith("-> retry")


@pytest.mark.parametrize("kind", list(FAULTY))
def test_an_answer_that_fails_twice_gives_way_to_the_sources_most_central_sentences(engine, harbour, monkeypatch,
                                                                                   extracted, kind):
    decode = Scripted(engine.loaded.tokenizer, [FAULTY[kind], FAULTY[kind]])
    monkeypatch.setattr(summarizer_module, "decode_from_cache", decode)
    result = engine.process(harbour[:300])
    assert len(decode.asked) == 2  # retried once, not more
    assert len(extracted) == 1 and result.summary == extracted[0]
    assert harbour.startswith(extracted[0].removesuffix(" …").rstrip())  # the text's own words
    (checked,) = result.stats.quality
    assert (checked.path, [f.kind for f in checked.faults]) == (EXTRACTIVE, [kind, kind])
    meta = SummaryCheck.of(result.stats.quality)
    assert (meta.retried, meta.extractive, meta.faults[kind]) == (0, 1, 2)
    assert meta.why.endswith("-> extractive")


@pytest.mark.parametrize(("arch", "prefilled_again"), [("qwen3_moe", 0), ("qwen3_next", 1), ("gpt_oss", 1)])
def test_the_retry_is_decoded_from_the_sections_cache_as_if_its_whole_prompt_were_run(engine, tiny, orchard, arch,
                                                                                     prefilled_again, monkeypatch):
    """The cache is cut back to the section where every layer allows it (attention), else prefilled again (Qwen3-Next's
    linear attention and gpt-oss's sliding window keep no history): either way the retry is what greedy generation on
    its whole prompt gives."""
    folder = str(tiny(arch))
    other = Engine.load(replace(engine.settings, model=folder))
    decode, answers = summarizer_module.decode_from_cache, []

    def faulty_first(model, prompt, cache, *rest) -> list[int]:
        answers.append(decode(model, prompt, cache, *rest))  # the cache holds the answer too, as after a real one
        return answers[-1] if len(answers) > 1 else text_tokens(other.loaded.tokenizer, FAULTY[ECHO])

    monkeypatch.setattr(summarizer_module, "decode_from_cache", faulty_first)
    prefills = []
    prefill = summarizer_module.Summarizer._prefill
    monkeypatch.setattr(summarizer_module.Summarizer, "_prefill", lambda *a: prefills.append(1) or prefill(*a))
    text = orchard[:700]
    result = other.process(text)
    assert result.stats.quality[0].faults[0].kind == ECHO and len(answers) == 2
    assert len(prefills) == prefilled_again  # one section: no combine prefilled
    reference = load_model(folder)
    frame = PromptFrame.build(reference.tokenizer, SUMMARIZE_AGAIN)
    prompt = torch.tensor([frame.prefix + text_tokens(reference.tokenizer, text) + frame.suffix])
    stop = stop_ids(reference.model, reference.tokenizer)
    with torch.no_grad():
        out = reference.model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                       max_new_tokens=engine.settings.summary_tokens, eos_token_id=stop,
                                       pad_token_id=stop[0],
                                       logits_processor=[NoRepeatInAnswer(prompt.shape[1], NO_REPEAT_AGAIN)])
    expected = out[0, prompt.shape[1]:].tolist()
    while expected and expected[-1] in stop:
        expected.pop()
    assert answers[1] == expected and expected


def test_the_combine_is_checked_as_each_section_summary_is(engine, harbour, monkeypatch, extracted):
    text = "\n\n".join([harbour[:300]] * (2 * engine.section_tokens // 300 + 2))  # each section tells of the same
    sections = math.ceil(len(engine.loaded.tokenizer(text, add_special_tokens=False)["input_ids"]) /
                         engine.section_tokens)
    echo = "A summary of one part of a long document is a clear and concise description."  # the demo model's, once
    decode = Scripted(engine.loaded.tokenizer, [FAITHFUL] * sections + [echo, FAITHFUL])
    monkeypatch.setattr(summarizer_module, "decode_from_cache", decode)
    result = engine.process(text)
    assert COMBINE in decode.asked[-2][0] and COMBINE_AGAIN in decode.asked[-1][0]
    assert [(c.kind, c.path) for c in result.stats.quality] == [(SECTION, FIRST)] * sections + [(COMBINED, RETRY)]
    assert result.summary.startswith(FAITHFUL) and extracted == []
    why = SummaryCheck.of(result.stats.quality).why
    assert why == "combine 1: echo (quotes the instruction: 'one part long document') -> retry"


def test_section_tokens_caps_each_section_and_each_is_prefilled_on_its_own(engine, harbour, summary_prefix):
    capped = Engine.load(replace(engine.settings, section_tokens=250))
    text = harbour[:600]  # one section under the context's own limit; three of 250, 250 and 100 tokens here
    result = capped.process(text)
    assert result.stats.sections == 3 and result.stats.reduce_rounds >= 1
    # the second section's chunks are those of that section processed as a document of its own
    alone = engine.process(text[250:500]).embeddings[:-1]
    first = math.ceil((len(summary_prefix) + 250) / engine.chunk_tokens)
    np.testing.assert_allclose(result.embeddings[first:first + len(alone)], alone, atol=1e-5)


def test_a_section_length_past_the_context_is_the_context(reference):
    context = SummaryPrompts.fit(reference, 16, 0).section_tokens
    assert SummaryPrompts.fit(reference, 16, 10**6).section_tokens == context < reference.context_tokens
    assert SummaryPrompts.fit(reference, 16, 250).section_tokens == 250


def test_a_summary_budget_that_leaves_no_room_in_the_context_is_refused_naming_the_most_it_allows(reference):
    with pytest.raises(ValueError, match=r"summary_tokens=400 is too large for .* context of 1024") as refused:
        SummaryPrompts.fit(reference, 400, 0)
    most = int(re.search(r"at most (\d+)", str(refused.value))[1])
    SummaryPrompts.fit(reference, most, 0)
    with pytest.raises(ValueError, match="too large"):
        SummaryPrompts.fit(reference, most + 1, 0)


def test_the_engine_refuses_a_summary_budget_its_context_cannot_hold(engine):
    with pytest.raises(ValueError, match=r"summary_tokens=400 is too large"):
        Engine.load(replace(engine.settings, summary_tokens=400))
