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
from npumoe.engine.generate.section_cache import PreallocatedLayer
from npumoe.engine.generate.sentences import finished_sentences
from npumoe.engine.generate.summarizer import SummaryPrompts
from npumoe.engine.generate.summary import (
    NO_REPEAT,
    OUTLINE_HEADING,
    OUTLINE_WORDS,
    SUMMARIZE,
    NoRepeatInAnswer,
    PromptFrame,
    joined_lines,
    opening,
    stop_ids,
)


def test_the_summary_is_what_greedy_generation_on_the_whole_prompt_gives(engine, reference, orchard):
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
def test_models_whose_cache_is_more_than_attention_prefill_in_chunks_into_their_own_cache(engine, tiny, orchard, arch):
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
                                                                                monkeypatch):
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


def test_a_section_summary_that_echoes_the_instruction_gives_way_to_the_sections_opening(engine, harbour,
                                                                                         monkeypatch):
    tokenizer = engine.loaded.tokenizer
    echo = tokenizer("A summary of the text above in plain English.", add_special_tokens=False)["input_ids"]
    calls = []
    monkeypatch.setattr(summarizer_module, "decode_from_cache", lambda *a: calls.append(1) or list(echo))
    result = engine.process(harbour[:300])
    assert calls == [1] and result.stats.sections == 1
    assert result.summary == opening(joined_lines(harbour[:300]), OUTLINE_WORDS) != ""


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
