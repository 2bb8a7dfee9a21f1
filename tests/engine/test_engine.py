"""Engine.process: chunked prefill, embeddings, a summary decoded from the cache, map-reduce, progress."""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Iterator
from dataclasses import replace
from itertools import pairwise

import numpy as np
import pytest
import torch

from npumoe.engine import Engine, EngineSettings, Progress, load_model
from npumoe.engine import api as engine_module
from npumoe.engine.generate.summary import (
    FEWEST,
    NO_REPEAT,
    OUTLINE_HEADING,
    OUTLINE_WORDS,
    SUMMARIZE,
    NoRepeatInAnswer,
    PromptFrame,
    answer_tokens,
    echoes,
    joined_lines,
    opening,
    stop_ids,
    whole_sentences,
)

CHUNK = 128
SUMMARY_TOKENS = 16


@pytest.fixture(scope="module")
def folder(tiny) -> str:
    return str(tiny("qwen3_moe"))


@pytest.fixture(scope="module")
def api(folder) -> Engine:
    # fp32, as the reference (load_model's default) is: weights auto may choose bf16 here
    return Engine.load(EngineSettings(model=folder, chunk_tokens=CHUNK, summary_tokens=SUMMARY_TOKENS, weights="fp32"))


@pytest.fixture(scope="module")
def reference(folder):
    return load_model(folder)


@pytest.fixture(scope="module")
def prefix(reference) -> list[int]:
    """The summary prompt's tokens before the document; they share the first prefill chunk."""
    return PromptFrame.build(reference.tokenizer, SUMMARIZE).prefix


def test_a_document_gives_one_normalised_embedding_per_chunk_plus_the_document(api, harbour, prefix):
    result = api.process(harbour[:600])
    chunks = math.ceil((len(prefix) + 600) / CHUNK)
    assert result.embeddings.shape == (chunks + 1, 64)
    assert result.embeddings.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(result.embeddings, axis=1), 1.0, rtol=1e-5)
    assert result.stats.chunks == chunks and result.stats.tokens == 600
    assert isinstance(result.summary, str)


def test_embeddings_are_mean_pooled_final_hidden_states_as_one_uncached_forward_gives_them(
        api, reference, harbour, prefix):
    text = harbour[:500]
    result = api.process(text)
    ids = prefix + list(text.encode())
    with torch.no_grad():
        hidden = reference.model.base_model(torch.tensor([ids])).last_hidden_state[0]  # (P + 500, H)
    # Chunks cut the prefilled stream (prefix, then document); each pools its document tokens.
    document_chunks = [c[max(0, len(prefix) - i * CHUNK):] for i, c in enumerate(hidden.split(CHUNK))]
    chunk_means = torch.stack([c.mean(0) for c in document_chunks])
    document = hidden[len(prefix):].mean(0, keepdim=True)
    expected = torch.nn.functional.normalize(torch.cat([chunk_means, document]), dim=-1)
    np.testing.assert_allclose(result.embeddings, expected.numpy(), atol=1e-4)


def test_the_summary_is_what_greedy_generation_on_the_whole_prompt_gives(api, reference, orchard):
    text = orchard[:700]
    result = api.process(text)
    assert result.summary == greedy_summary(reference, text)
    assert result.summary  # the random model does say something


def greedy_summary(loaded, text: str) -> str:
    """What `generate` says, greedily and without repeating the answer's n-grams, after the whole summary prompt in
    one forward, up to its last finished sentence."""
    frame = PromptFrame.build(loaded.tokenizer, SUMMARIZE)
    prompt = torch.tensor([frame.prefix + list(text.encode()) + frame.suffix])
    stop = stop_ids(loaded.model, loaded.tokenizer)
    with torch.no_grad():
        out = loaded.model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                    max_new_tokens=SUMMARY_TOKENS, eos_token_id=stop, pad_token_id=stop[0],
                                    logits_processor=[NoRepeatInAnswer(prompt.shape[1], NO_REPEAT)])
    return whole_sentences(joined_lines(loaded.tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True)))


@pytest.mark.parametrize("arch", ["qwen3_next", "nemotron_h", "lfm2_moe", "gpt_oss"])
def test_models_whose_cache_is_more_than_attention_prefill_in_chunks_into_their_own_cache(tiny, orchard, arch):
    """Linear attention (Qwen3-Next), Mamba (Nemotron-H), short convolutions (LFM2) and sliding windows (gpt-oss)
    keep state the chunks must carry: the summary decoded from the chunk-prefilled cache is what greedy
    generation on the whole prompt gives."""
    folder = str(tiny(arch))
    api = Engine.load(EngineSettings(model=folder, chunk_tokens=CHUNK, summary_tokens=SUMMARY_TOKENS,
                                        weights="fp32"))
    text = orchard[:700]
    result = api.process(text)
    assert result.stats.chunks > 1
    assert result.summary == greedy_summary(load_model(folder), text)
    assert result.summary


def test_stats_name_tokens_chunks_phases_and_dispatch_counts(api, harbour, prefix):
    stats = api.process(harbour[:300]).stats
    assert set(stats.seconds) == {"prefill", "summary", "reduce", "total"}
    assert (stats.tokens, stats.chunk_tokens) == (300, CHUNK)
    json.dumps(stats.dispatch.to_dict())
    assert {"dropped_fraction", "padding_fraction"} <= stats.dispatch.to_dict().keys()
    # Prefill only (decode is not counted): the prompt prefix and the document, top-8, 3 layers.
    assert stats.dispatch.assignments == (len(prefix) + 300) * 8 * 3 == stats.dispatch.cpu


def test_progress_is_reported_after_every_chunk_and_the_summary(api, harbour, prefix):
    seen: list[Progress] = []
    api.process(harbour[:700], on_progress=seen.append)
    prefill = [p for p in seen if p.phase == "prefill"]
    chunks = math.ceil((len(prefix) + 700) / CHUNK)
    assert [p.chunks_done for p in prefill] == list(range(1, chunks + 1))
    assert {p.chunks_total for p in prefill} == {chunks}
    assert [p.tokens_done for p in prefill] == [min(700, i * CHUNK - len(prefix)) for i in range(1, chunks + 1)]
    assert {p.tokens_total for p in prefill} == {700}
    assert seen[-1].phase == "summary" and (seen[-1].chunks_done, seen[-1].chunks_total) == (1, 1)
    assert all(a.elapsed_s <= b.elapsed_s for a, b in pairwise(seen))


def test_raising_from_progress_aborts_the_document_and_leaves_the_engine_usable(api, harbour):
    def stop_after_two(progress: Progress) -> None:
        if progress.chunks_done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        api.process(harbour[:700], on_progress=stop_after_two)
    assert api.process(harbour[:200]).stats.tokens == 200


class DecodeSteps:
    """Counts decode steps: `generate` runs the whole model once a step, while prefill runs only its base model."""

    def __init__(self) -> None:
        self.count = 0

    def step(self, *_: object) -> None:
        self.count += 1


@pytest.fixture
def decode_steps(api) -> Iterator[DecodeSteps]:
    steps = DecodeSteps()
    handle = api.loaded.model.register_forward_hook(steps.step)
    yield steps
    handle.remove()


class Stopped(Exception):
    """What a caller's check raises to stop the document."""


MOE_LAYERS = 3  # of the tiny qwen3_moe


def test_the_check_runs_before_every_moe_layer_of_every_prefill_chunk(api, harbour, prefix):
    checks = [0]
    per_chunk: list[int] = []  # checks run up to each chunk's progress report
    api.process(harbour[:700], check=lambda: checks.__setitem__(0, checks[0] + 1),
                on_progress=lambda p: per_chunk.append(checks[0]) if p.phase == "prefill" else None)
    chunks = math.ceil((len(prefix) + 700) / CHUNK)
    assert per_chunk == [MOE_LAYERS * i for i in range(1, chunks + 1)]


PAUSE_AFTER = 3  # decode steps of the summary before the check pauses


def test_a_pause_during_the_summary_takes_effect_within_one_decode_step(api, orchard, decode_steps):
    text = orchard[:300]
    unpaused = api.process(text)
    assert unpaused.stats.generated_tokens > PAUSE_AFTER + 1  # the summary goes on past the pause
    decode_steps.count = 0
    waiting, resume = threading.Event(), threading.Event()
    waited_at: list[int] = []

    def check() -> None:  # pauses once, PAUSE_AFTER steps into the summary, until resumed
        if decode_steps.count >= PAUSE_AFTER and not resume.is_set():
            waited_at.append(decode_steps.count)
            waiting.set()
            resume.wait()

    steps_while_paused: list[int] = []

    def resume_once_waiting() -> None:
        waiting.wait()
        steps_while_paused.append(decode_steps.count)  # the engine is held inside the check
        resume.set()

    resumer = threading.Thread(target=resume_once_waiting)
    resumer.start()
    paused = api.process(text, check=check)
    resumer.join()
    assert waited_at == [PAUSE_AFTER] and steps_while_paused == [PAUSE_AFTER]  # no further step ran
    assert decode_steps.count > PAUSE_AFTER  # and decoding went on once resumed
    assert paused.summary == unpaused.summary


def test_a_stop_during_a_combine_ends_it_within_one_decode_step(api, harbour, orchard, decode_steps):
    text = harbour + "\n\n" + orchard  # longer than the context: sections, then their summaries combined
    map_done: list[int] = []  # decode steps when the last section's summary was reported
    stopped_at: list[int] = []

    def on_progress(p: Progress) -> None:
        if p.phase == "summary" and p.chunks_done == p.chunks_total:
            map_done.append(decode_steps.count)

    def check() -> None:
        if map_done and decode_steps.count >= map_done[0] + 2:  # two steps into the first combine
            stopped_at.append(decode_steps.count)
            raise Stopped

    with pytest.raises(Stopped):
        api.process(text, on_progress=on_progress, check=check)
    assert stopped_at == [map_done[0] + 2] and decode_steps.count == stopped_at[0]  # no further step ran
    assert api.process(harbour[:200]).stats.tokens == 200  # the check went with the call


def test_a_document_longer_than_the_context_is_summarised_in_sections_then_combined(api, harbour, orchard):
    text = harbour + "\n\n" + orchard
    seen: list[Progress] = []
    result = api.process(text, on_progress=seen.append)
    stats = result.stats
    assert stats.tokens == len(text.encode()) > api.loaded.context_tokens  # nothing truncated
    assert stats.sections == math.ceil(stats.tokens / api._section_tokens) >= 2
    assert stats.reduce_rounds >= 1
    assert {p.phase for p in seen} == {"prefill", "summary", "reduce"}
    assert result.embeddings.shape[0] == stats.chunks + 1
    assert max(p.tokens_done for p in seen) == stats.tokens


def test_a_combined_summary_ends_with_each_combined_parts_opening_one_line_each(api, harbour, orchard,
                                                                                       monkeypatch):
    answers: list[list[int]] = []
    prompts: list[list[int]] = []
    decode = engine_module.decode_from_cache
    monkeypatch.setattr(engine_module, "decode_from_cache",
                        lambda model, prompt, *a: prompts.append(prompt) or answers.append(decode(model, prompt, *a))
                        or answers[-1])
    result = api.process(harbour + "\n\n" + orchard)
    sections = result.stats.sections
    assert result.stats.reduce_rounds == 1 and len(answers) == sections + 1  # the sections', then one combine
    overview, _, lines = result.summary.partition(f"\n\n{OUTLINE_HEADING}\n")
    tokenizer = api.loaded.tokenizer
    parts = [joined_lines(tokenizer.decode(a, skip_special_tokens=True)) for a in answers[:sections]]
    assert lines.split("\n") == [f"{i}. {opening(p, OUTLINE_WORDS)}" for i, p in enumerate(parts, 1)
                                 if p.strip()]
    assert overview == whole_sentences(joined_lines(tokenizer.decode(answers[-1], skip_special_tokens=True)))
    combine_input = tokenizer.decode(prompts[-1])  # each section's summary after its label, in order
    labelled = [combine_input.find(f"Part {i}: {tokenizer.decode(a)}") for i, a in enumerate(answers[:sections], 1)]
    assert -1 not in labelled and labelled == sorted(labelled)


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


def test_a_section_summary_that_echoes_the_instruction_gives_way_to_the_sections_opening(api, harbour, monkeypatch):
    tokenizer = api.loaded.tokenizer
    echo = tokenizer("A summary of the text above in plain English.", add_special_tokens=False)["input_ids"]
    calls = []
    monkeypatch.setattr(engine_module, "decode_from_cache", lambda *a: calls.append(1) or list(echo))
    result = api.process(harbour[:300])
    assert calls == [1] and result.stats.sections == 1
    assert result.summary == opening(joined_lines(harbour[:300]), OUTLINE_WORDS) != ""


def test_section_tokens_caps_each_section_and_each_is_prefilled_on_its_own(folder, api, harbour, prefix):
    capped = Engine.load(replace(api.settings, section_tokens=250))
    text = harbour[:600]  # one section under the context's own limit; three of 250, 250 and 100 tokens here
    result = capped.process(text)
    assert result.stats.sections == 3 and result.stats.reduce_rounds >= 1
    # the second section's chunks are those of that section processed as a document of its own
    alone = api.process(text[250:500]).embeddings[:-1]
    first = math.ceil((len(prefix) + 250) / CHUNK)
    np.testing.assert_allclose(result.embeddings[first:first + len(alone)], alone, atol=1e-5)


def test_a_section_length_past_the_context_is_the_context(api):
    wide = Engine.load(replace(api.settings, section_tokens=10**6))
    assert wide._section_tokens == api._section_tokens < 10**6


@pytest.mark.parametrize("text", ["", "  \n\t "])
def test_an_empty_document_is_refused(api, text):
    with pytest.raises(ValueError, match="empty or whitespace only"):
        api.process(text)


@pytest.mark.parametrize(("change", "message"), [
    ({"backend": "tpu"}, "unknown backend 'tpu'"),
    ({"overflow": "drop"}, "overflow must be one of spill, prune"),
    ({"dtype": "float16"}, "dtype must be one of float32, bfloat16"),
    ({"chunk_tokens": -1}, r"chunk_tokens must be 0 \(measured\) or positive"),
    ({"threads": 0}, "threads must be positive"),
    ({"section_tokens": -1}, r"section_tokens must be 0 \(as long as the context allows\) or positive"),
    ({"backend": "coreml"}, "the coreml backend needs compiled_dir"),
    ({"coreml_compute_units": "gpu_only"}, "coreml_compute_units must be one of cpu_and_ne, all"),
])
def test_bad_settings_are_refused_by_name(folder, change, message):
    with pytest.raises(ValueError, match=message):
        EngineSettings(model=folder, **change)


def test_a_summary_budget_that_leaves_no_room_in_the_context_is_refused_naming_the_most_it_allows(folder):
    with pytest.raises(ValueError, match=r"summary_tokens=400 is too large for .* context of 1024") as refused:
        Engine.load(EngineSettings(model=folder, summary_tokens=400))
    most = int(re.search(r"at most (\d+)", str(refused.value))[1])
    Engine.load(EngineSettings(model=folder, summary_tokens=most))
    with pytest.raises(ValueError, match="too large"):
        Engine.load(EngineSettings(model=folder, summary_tokens=most + 1))


def test_bfloat16_runs_and_gives_finite_embeddings(folder, harbour):
    api = Engine.load(EngineSettings(model=folder, dtype="bfloat16", chunk_tokens=CHUNK, summary_tokens=4))
    result = api.process(harbour[:300])
    assert np.isfinite(result.embeddings).all() and result.embeddings.dtype == np.float32


def test_the_model_key_is_the_loaded_checkpoint_key_and_close_restores_eager(folder, reference):
    api = Engine.load(EngineSettings(model=folder))
    assert api.model_key == reference.key
    assert api.loaded.model.config._experts_implementation == "npumoe"
    api.close()
    assert api.loaded.model.config._experts_implementation == "eager"


def test_each_chunk_knows_the_characters_its_tokens_came_from(api, harbour, prefix):
    text = "Grüße — " + harbour[:600]  # multi-byte characters: one character, several byte tokens
    result = api.process(text)
    spans = result.spans.tolist()
    assert len(spans) == result.stats.chunks and result.spans.dtype == np.int64
    assert spans[0][0] == 0 and spans[-1][1] == len(text)
    assert all(a[1] <= b[0] + 1 for a, b in pairwise(spans))  # consecutive (a split character is in both)
    ascii_spans = api.process(harbour[:600]).spans  # one byte, one token, one character
    sizes = [CHUNK - len(prefix), *[CHUNK] * (len(ascii_spans) - 2)]
    assert (ascii_spans[:-1, 1] - ascii_spans[:-1, 0]).tolist() == sizes


def test_spans_come_from_decoded_lengths_for_a_tokenizer_without_offsets(api, harbour, monkeypatch):
    with_offsets = api.process(harbour[:600]).spans
    calls = []
    decoded_spans = engine_module._decoded_spans
    monkeypatch.setattr(engine_module, "_decoded_spans", lambda *args: calls.append(args) or decoded_spans(*args))
    monkeypatch.setattr(type(api.loaded.tokenizer), "is_fast", property(lambda self: False))
    decoded = api.process(harbour[:600]).spans
    assert len(calls) == 1
    np.testing.assert_array_equal(decoded, with_offsets)  # ASCII: a chunk's decoded length is its byte count


@pytest.mark.parametrize("length", [300, 700])
def test_a_texts_vector_is_made_the_way_a_documents_vector_is(api, harbour, orchard, length):
    text = harbour[:length]
    vector = api.embed(text)
    assert vector.shape == (64,) and vector.dtype == np.float32
    np.testing.assert_allclose(vector, api.process(text).embeddings[-1], atol=1e-5)
    assert float(vector @ api.embed(orchard[:length])) < 0.9999  # another text, another vector


def test_a_text_longer_than_a_section_is_embedded_section_by_section(api, harbour, orchard):
    text = harbour + "\n\n" + orchard
    result = api.process(text)
    assert result.stats.sections >= 2
    np.testing.assert_allclose(api.embed(text), result.embeddings[-1], atol=1e-5)


def test_an_empty_text_is_not_embedded(api):
    with pytest.raises(ValueError, match="empty or whitespace only"):
        api.embed(" \n")


def test_a_summary_is_at_most_a_third_of_its_text_but_a_few_sentences_at_least() -> None:
    assert answer_tokens(3000, 128) == 128  # a long text: the configured budget
    assert answer_tokens(192, 128) == 64  # a short one: a third of it, or the summary would be a copy
    assert answer_tokens(60, 128) == FEWEST
    assert answer_tokens(192, 16) == 16  # never more than configured


def test_a_pdfs_hard_wrapped_lines_are_joined_but_paragraphs_and_lists_keep_theirs() -> None:
    assert joined_lines("A job that\nfailed.\n\n- one\n- two") == "A job that failed.\n\n- one\n- two"
