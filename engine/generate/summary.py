"""Summaries: the prompt around a text, and greedy decoding from a prefilled KV cache."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import (
    DynamicCache,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from .sentences import stop_ends

# Asked after the text, where a small model still sees it when it starts to answer.
SUMMARIZE = "Summarize the text above in a few sentences of plain English."
# Each summary it combines is labelled "Part i:". Asked to "write one summary", SmolLM2-135M wrote about summaries
# (the night-shift log's own subject in one part); asked what the document is about, it takes from several parts.
COMBINE = ("Each part above is the summary of one part of a long document, in order. In a few sentences, say what "
           "the whole document is about.")

# Greedy decoding falls into loops; a summary never needs to say the same NO_REPEAT words twice. Only the answer's
# own n-grams count: transformers' no_repeat_ngram_size also counts the prompt's, which would forbid quoting it.
NO_REPEAT = 4

# A summary at most a third as long as its text (one as long is a copy, which is what a small model writes for a
# short text), and never shorter than a few sentences' worth.
SHARE, FEWEST = 3, 48

# A long document's summary ends with one line per part it was cut into: the part's own summary's opening sentences,
# at least a clause's worth of words (a log's part may open with "Night 3.") and at most a long sentence's. A small
# model's combined summary may keep to one part; the lines still say what each is about.
OUTLINE_WORDS = (8, 40)
OUTLINE_HEADING = "By part:"

_STEM, _ECHO = 5, 0.8  # letters a word is known by; the share of an answer's words that makes it an echo
_MARK = "\x00TEXT\x00"  # stands in for the text while the chat template is rendered

# Chat-template switches that ask for an answer without reasoning first (Qwen3, GLM-4.5), or with the least of it
# (gpt-oss cannot turn it off). A template gets only the ones it reads.
THINKING_OFF: dict[str, object] = {"enable_thinking": False, "reasoning_effort": "low"}

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_THINK_BLOCK = re.compile(f"{THINK_OPEN}.*?(?:{THINK_CLOSE}|\\Z)", re.S)  # an unclosed one runs to the end
# gpt-oss's harmony format: <|channel|>NAME<|message|>TEXT, ended by the next control token or the end
_HARMONY_MESSAGE = re.compile(r"<\|channel\|>(.*?)<\|message\|>(.*?)(?=<\|(?:end|return|call|start|channel)\|>|\Z)",
                              re.S)


@dataclass(frozen=True)
class PromptFrame:
    """prefix + text + suffix asks the model for a summary of the text (the instruction is in the suffix)."""

    prefix: list[int]
    suffix: list[int]

    @classmethod
    def build(cls, tokenizer: PreTrainedTokenizerBase, instruction: str) -> PromptFrame:
        """The model's chat template (a user turn, then the assistant's turn opens) when it has one, with
        thinking turned off where the template has a switch for it."""
        if tokenizer.chat_template:
            plain = _render(tokenizer, instruction)
            # A switch the template reads changes what it renders; one it ignores would be passed for nothing.
            switches = {name: value for name, value in THINKING_OFF.items()
                        if _render(tokenizer, instruction, **{name: value}) != plain}
            before, after = _render(tokenizer, instruction, **switches).split(_MARK)
        else:
            before, after = "", f"\n\n{instruction}\n\nSummary:\n"
        return cls(prefix=text_tokens(tokenizer, before), suffix=text_tokens(tokenizer, after))

    @property
    def overhead(self) -> int:
        return len(self.prefix) + len(self.suffix)


@torch.inference_mode()
def decode_from_cache(model: PreTrainedModel, prompt: Sequence[int], cache: DynamicCache, max_new_tokens: int,
                      stop_ids: Sequence[int]) -> list[int]:
    """Greedy continuation of `prompt`, whose first tokens `cache` already holds; without the stop token."""
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=model.device)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(stop_ids),
                              pad_token_id=stop_ids[0])
    no_repeat = LogitsProcessorList([NoRepeatInAnswer(ids.shape[1], NO_REPEAT)])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache,
                         generation_config=config, logits_processor=no_repeat)
    new = out[0, ids.shape[1]:].tolist()
    while new and new[-1] in stop_ids:
        new.pop()
    return new


class NoRepeatInAnswer(LogitsProcessor):
    """Forbids the token that would repeat an n-gram the answer (what follows the first `start` tokens) already
    holds."""

    def __init__(self, start: int, n: int) -> None:
        self.start, self.n = start, n

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for row, ids in enumerate(input_ids[:, self.start:].tolist()):
            if len(ids) < self.n:
                continue
            tail = tuple(ids[len(ids) - self.n + 1:])
            banned = [ids[i + self.n - 1] for i in range(len(ids) - self.n + 1) if tuple(ids[i:i + self.n - 1]) == tail]
            scores[row, banned] = -float("inf")
        return scores


def answer_tokens(text_tokens: int, most: int) -> int:
    """The new tokens a summary of a `text_tokens`-token text may take: `most`, less for a short text."""
    return min(most, max(FEWEST, text_tokens // SHARE))


def opening(text: str, words: tuple[int, int]) -> str:
    """`text`'s first finished sentences, as few as hold at least words[0] words (all of it when they do not), on one
    line, cut to words[1] words with an ellipsis when longer."""
    least, most = words
    text = text.strip()
    said: list[str] = []
    for end in [*stop_ends(text), len(text)]:
        said = text[:end].split()
        if len(said) >= least:
            break
    return " ".join(said[:most]) + (" …" if len(said) > most else "")


def echoes(answer: str, instruction: str) -> bool:
    """Whether `answer` only says the instruction back ("A summary of the text above in plain English."): nearly all
    its words are the instruction's (by their first letters, so "summary" is "Summarize"). A 135M model does this for
    a section now and then; an answer that says anything of the text has words of its own."""
    words = [w[:_STEM] for w in re.findall(r"[a-z]{3,}", answer.lower())]
    said = {w[:_STEM] for w in re.findall(r"[a-z]{3,}", instruction.lower())}
    return bool(words) and sum(w in said for w in words) >= _ECHO * len(words)


def outline(parts: Sequence[str], words: tuple[int, int] = OUTLINE_WORDS) -> str:
    """A numbered line per part, in order: each part's summary condensed to its opening."""
    lines = [f"{i}. {opening(part, words)}" for i, part in enumerate(parts, 1) if part.strip()]
    return "\n".join([OUTLINE_HEADING, *lines])


def joined_lines(text: str) -> str:
    """`text` with the line breaks inside its paragraphs made spaces: a small model copies the hard-wrapped lines of a
    PDF's text into its summary. Paragraph breaks and list items keep their lines."""
    return re.sub(r"[ \t]*(?<!\n)\n(?![\n\-*•]|\d+[.)] )[ \t]*", " ", text)


def stop_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The tokens that end a turn: the model's generation eos ids and the tokenizer's eos."""
    configured = model.generation_config.eos_token_id
    ids = configured if isinstance(configured, list) else [configured]
    return list(dict.fromkeys(i for i in [*ids, tokenizer.eos_token_id] if i is not None))


def without_thinking(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> list[int]:
    """A decoded answer's tokens with any reasoning the model wrote first taken out; `ids` as they are when
    there is none."""
    said = tokenizer.decode(ids, skip_special_tokens=False)
    answer = strip_thinking(said)
    return list(ids) if answer == said else text_tokens(tokenizer, answer.strip())


def strip_thinking(text: str) -> str:
    """`text` without <think>…</think> blocks, or, in gpt-oss's harmony format, only its final channel."""
    if "<|channel|>" in text:
        return "".join(body for header, body in _HARMONY_MESSAGE.findall(text) if header.split()[:1] == ["final"])
    opened, closed = text.find(THINK_OPEN), text.find(THINK_CLOSE)
    if closed != -1 and (opened == -1 or closed < opened):  # the prompt opened the block: it starts the text
        text = text[closed + len(THINK_CLOSE):]
    return _THINK_BLOCK.sub("", text)


def _render(tokenizer: PreTrainedTokenizerBase, instruction: str, **switches: object) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": f"{_MARK}\n\n{instruction}"}],
                                         add_generation_prompt=True, tokenize=False, **switches)


def text_tokens(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """`text`'s token ids, without the special tokens a tokenizer may add around a whole input."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]
