"""Summaries: the prompt around a text, and greedy decoding from a prefilled KV cache."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

SUMMARIZE = "Summarize the following document."
COMBINE = "Combine these partial summaries of one document into a single summary."

_MARK = "\x00TEXT\x00"  # stands in for the text while the chat template is rendered


@dataclass(frozen=True)
class PromptFrame:
    """prefix + text + suffix asks the model for a summary of the text."""

    prefix: list[int]
    suffix: list[int]

    @classmethod
    def build(cls, tokenizer: PreTrainedTokenizerBase, instruction: str) -> PromptFrame:
        """The model's chat template (a user turn, then the assistant's turn opens) when it has one."""
        if tokenizer.chat_template:
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": f"{instruction}\n\n{_MARK}"}], add_generation_prompt=True,
                tokenize=False)
            before, after = rendered.split(_MARK)
        else:
            before, after = f"{instruction}\n\n", "\n\nSummary:\n"
        return cls(prefix=_encode(tokenizer, before), suffix=_encode(tokenizer, after))

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
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache,
                         generation_config=config)
    new = out[0, ids.shape[1]:].tolist()
    while new and new[-1] in stop_ids:
        new.pop()
    return new


def stop_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The tokens that end a turn: the model's generation eos ids and the tokenizer's eos."""
    configured = model.generation_config.eos_token_id
    ids = configured if isinstance(configured, list) else [configured]
    return list(dict.fromkeys(i for i in [*ids, tokenizer.eos_token_id] if i is not None))


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]
