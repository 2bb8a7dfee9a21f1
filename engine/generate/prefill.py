"""Chunked prefill: fixed-length chunks through the model, the KV cache carried across chunks."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence

import torch
from transformers import Cache, DynamicCache, PreTrainedModel

from .section_cache import preallocate


def new_cache(model: PreTrainedModel, capacity: int | None = None) -> Cache:
    """An empty cache of the kind the model's `generate` uses; with `capacity`, its attention layers' keys and
    values are written in place into buffers of that many tokens (section_cache), made once.

    Most models take transformers' DynamicCache built from the decoder's text config, which gives each layer the
    cache it needs (attention keys and values, a sliding window, or the convolution and recurrent state of a
    linear-attention layer in hybrid models such as Qwen3-Next). A model that makes a cache class of its own in
    its forward (MiniMax), where `generate` leaves it to the model, gets that class, made empty as its forward
    makes it."""
    if model._supports_default_dynamic_cache():
        cache = DynamicCache(config=model.config.get_text_config(decoder=True))
        return cache if capacity is None else preallocate(cache, capacity)
    code = sys.modules[type(model).__module__]
    own = [c for c in vars(code).values()
           if isinstance(c, type) and issubclass(c, Cache) and c.__module__ == code.__name__]
    if len(own) != 1:
        raise ValueError(f"{type(model).__name__} keeps a cache of its own that the engine cannot make "
                         f"(its code defines {len(own)} cache classes), so it cannot prefill in chunks")
    return own[0]()


@torch.inference_mode()
def prefill(model: PreTrainedModel, ids: Sequence[int], chunk_tokens: int, cache: Cache, *,
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
