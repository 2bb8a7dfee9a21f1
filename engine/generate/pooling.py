"""Search vectors from final hidden states: the pooling choices of vocabulary.POOLINGS.

Mean and last pool the hidden states of the prefill the summary needs anyway. The prompt pooling is
PromptEOL (Jiang et al. 2023, "Scaling Sentence Embeddings with Large Language Models"): each chunk
is prefilled once more on its own inside a prompt that asks for it in one word, and the hidden state
of the prompt's last token, the one that would say that word, is the vector. It costs a second
prefill of every chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from ..vocabulary import LAST, MEAN, POOLINGS

ONE_WORD = ('This passage : "', '" means in one word:"')  # PromptEOL's template, "sentence" made "passage"


def check_pooling(pooling: str) -> None:
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")


def pooled(hidden: torch.Tensor, pooling: str) -> torch.Tensor:
    """(H,) float32 vector of a chunk's hidden states (n, H): their mean, or the last one's (last, prompt)."""
    return hidden.float().mean(0) if pooling == MEAN else hidden[-1].float()


def prefill_pooling(pooling: str) -> str:
    """What to pool from the summary's prefill: the prompt pooling makes its vectors in a prefill of its own, and
    takes the mean there only as the placeholder it replaces."""
    return LAST if pooling == LAST else MEAN


@dataclass(frozen=True)
class OneWordFrame:
    """prefix + text + suffix asks the model to condense the text into one word."""

    prefix: list[int]
    suffix: list[int]

    @classmethod
    def build(cls, tokenizer: PreTrainedTokenizerBase) -> OneWordFrame:
        before, after = (tokenizer(part, add_special_tokens=False)["input_ids"] for part in ONE_WORD)
        return cls(prefix=before, suffix=after)

    def around(self, ids: Sequence[int]) -> list[int]:
        return [*self.prefix, *ids, *self.suffix]

