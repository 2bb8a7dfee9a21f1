"""Chunked prefill: fixed-length chunks through the model, the KV cache carried across chunks."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel


def new_cache(model: PreTrainedModel) -> DynamicCache:
    return DynamicCache(config=model.config)


@torch.inference_mode()
def prefill(model: PreTrainedModel, ids: Sequence[int], chunk_tokens: int, cache: DynamicCache, *,
            logits: bool = False) -> Iterator[torch.Tensor]:
    """Run `ids` through the model `chunk_tokens` at a time after what `cache` holds, extending it.

    Yields each chunk's final hidden states (n, H), or its logits (n, V) when `logits`. The caller
    sees every chunk boundary: that is where progress is reported and work can be paused or stopped.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk length must be positive, got {chunk_tokens}")
    step = model if logits else model.base_model
    for start in range(0, len(ids), chunk_tokens):
        chunk = torch.tensor([ids[start:start + chunk_tokens]], dtype=torch.long, device=model.device)  # (1, n)
        out = step(input_ids=chunk, cache=cache, use_cache=True)
        yield out.logits[0] if logits else out.last_hidden_state[0]


def windows(ids: Sequence[int], length: int) -> list[Sequence[int]]:
    """`ids` cut into consecutive pieces of at most `length` tokens."""
    return [ids[start:start + length] for start in range(0, len(ids), length)]
