"""Thinking-mode chat templates: summaries are asked for without reasoning where the template has a switch for
it, and reasoning a model writes all the same stays out of the summary."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from npumoe.engine import Engine, EngineSettings
from npumoe.engine.generate import summarizer as summarizer_module
from npumoe.engine.generate.summary import SUMMARIZE, PromptFrame, decode_from_cache, without_thinking
from npumoe.engine.synthetic.byte_tokenizer import build_byte_tokenizer

# Qwen3's switch, written small: thinking stays on unless the caller says enable_thinking=False, which pre-fills
# the assistant's turn with an empty thinking block.
QWEN3_LIKE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)
# gpt-oss's, written small: a reasoning level in the system message, read inside a macro, "medium" by default.
GPT_OSS_LIKE = (
    "{% macro system() %}{% if reasoning_effort is not defined %}{% set reasoning_effort = 'medium' %}{% endif %}"
    "{{ '<|start|>system<|message|>Reasoning: ' + reasoning_effort + '<|end|>' }}{% endmacro %}"
    "{{ system() }}"
    "{% for message in messages %}"
    "{{ '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}"
)
HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>"]
EMPTY_THINKING = "<think>\n\n</think>\n\n"


def tokenizer_with(template: str | None = None, special: Sequence[str] = (),
                   plain: Sequence[str] = ()) -> PreTrainedTokenizerBase:
    """The project's byte tokenizer with another chat template and added tokens (Qwen3's <think> tags are
    plain added tokens, gpt-oss's channel markers special ones)."""
    tokenizer = build_byte_tokenizer()
    if template is not None:
        tokenizer.chat_template = template
    tokenizer.add_tokens(list(special), special_tokens=True)
    tokenizer.add_tokens(list(plain))
    return tokenizer


def text_of(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_a_template_with_a_thinking_switch_is_rendered_with_thinking_off() -> None:
    tokenizer = tokenizer_with(QWEN3_LIKE, plain=["<think>", "</think>"])
    frame = PromptFrame.build(tokenizer, SUMMARIZE)
    # The template writes the empty block only when enable_thinking=False reached it.
    assert text_of(tokenizer, frame.suffix) == f"\n\n{SUMMARIZE}<|im_end|>\n<|im_start|>assistant\n{EMPTY_THINKING}"
    assert text_of(tokenizer, frame.prefix) == "<|im_start|>user\n"


def test_a_reasoning_level_is_set_to_the_lowest_where_the_template_reads_one() -> None:
    tokenizer = tokenizer_with(GPT_OSS_LIKE, special=HARMONY_TOKENS)
    frame = PromptFrame.build(tokenizer, SUMMARIZE)
    assert text_of(tokenizer, frame.prefix).startswith("<|start|>system<|message|>Reasoning: low<|end|>")
    assert text_of(tokenizer, frame.suffix) == f"\n\n{SUMMARIZE}<|end|><|start|>assistant"


def test_a_template_without_a_switch_renders_as_before() -> None:
    tokenizer = build_byte_tokenizer()  # ChatML, which reads neither switch
    frame = PromptFrame.build(tokenizer, SUMMARIZE)
    assert text_of(tokenizer, frame.prefix) == "<|im_start|>user\n"
    assert text_of(tokenizer, frame.suffix) == f"\n\n{SUMMARIZE}<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(("said", "answer"), [
    ("<think>\nThe user wants a summary.\n</think>\n\nShips dock at dawn.", "Ships dock at dawn."),
    ("Ships dock<think>a second thought</think> at dawn.", "Ships dock at dawn."),
    # the template opened the block in the prompt, so only its end is in the answer
    ("A summary, then.\n</think>\n\nShips dock at dawn.", "Ships dock at dawn."),
    ("<think>\nThe document is long and I ran out of", ""),
])
def test_thinking_blocks_are_taken_out_of_an_answer(said: str, answer: str) -> None:
    tokenizer = tokenizer_with(plain=["<think>", "</think>"])
    ids = tokenizer(said, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(without_thinking(tokenizer, ids), skip_special_tokens=True) == answer


@pytest.mark.parametrize(("said", "answer"), [
    ("<|channel|>analysis<|message|>Summarise the harbour.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>Ships dock at dawn.<|return|>", "Ships dock at dawn."),
    ("<|channel|>analysis<|message|>Summarise the harbour, then", ""),
])
def test_only_the_final_channel_of_a_harmony_answer_is_kept(said: str, answer: str) -> None:
    tokenizer = tokenizer_with(special=HARMONY_TOKENS)
    ids = tokenizer(said, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(without_thinking(tokenizer, ids), skip_special_tokens=True) == answer


def test_an_answer_without_thinking_keeps_its_tokens() -> None:
    tokenizer = tokenizer_with(plain=["<think>", "</think>"])
    ids = [*tokenizer("Ships dock at dawn, ", add_special_tokens=False)["input_ids"], 0xC3, 0x28, 258, 70]
    assert without_thinking(tokenizer, ids) == ids  # odd bytes and a special token, all as they were


def test_the_engine_asks_without_thinking_and_keeps_reasoning_out_of_the_summary(
        tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, harbour: str) -> None:
    folder = shutil.copytree(tiny("qwen3_moe"), tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = QWEN3_LIKE
    tokenizer.save_pretrained(folder)
    api = Engine.load(EngineSettings(model=str(folder), chunk_tokens=128, summary_tokens=16))
    prompts: list[list[int]] = []
    answers: list[list[int]] = []
    reasoning = tokenizer("<think>\nThe harbour text, in brief.\n</think>\n\n", add_special_tokens=False)["input_ids"]

    def reasoning_first(model, prompt, cache, max_new_tokens, stop) -> list[int]:  # a model that thinks anyway
        answer = decode_from_cache(model, prompt, cache, max_new_tokens, stop)
        prompts.append(list(prompt))
        answers.append(answer)
        return [*reasoning, *answer]

    monkeypatch.setattr(summarizer_module, "decode_from_cache", reasoning_first)
    result = api.process(harbour[:300])
    assert len(prompts) == 1
    assert text_of(tokenizer, prompts[0]).endswith(f"<|im_start|>assistant\n{EMPTY_THINKING}")
    assert answers[0], "the random model said nothing, so nothing was left after the reasoning"
    assert result.summary == tokenizer.decode(answers[0], skip_special_tokens=True).strip()
    assert result.stats.generated_tokens == len(reasoning) + len(answers[0])  # the thinking still counts
