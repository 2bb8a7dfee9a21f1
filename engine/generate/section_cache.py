"""A KV cache written in place: a section's keys and values live in buffers made once.

transformers' DynamicLayer concatenates each step's keys and values onto everything it holds, so every decode
step copies the whole cache (at a 40k-token section, gigabytes per token). A section's length is known before
its prefill starts (prompt, text, the answer's budget), so its buffers can be made once at that size and
each step's keys written after what they hold; attention reads a view of the filled part, not a copy.
"""

from __future__ import annotations

import torch
from transformers import Cache
from transformers.cache_utils import DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """One attention layer's keys and values, (B, H, capacity, D) buffers filled left to right. A section that
    outruns its capacity grows the buffers by doubling (one copy), so a wrong estimate costs time, never text."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.key_buffer = _buffer_like(key_states, self.capacity)
        self.value_buffer = _buffer_like(value_states, self.capacity)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.key_buffer is not None and self.value_buffer is not None
        end = self.length + key_states.shape[-2]
        if end > self.key_buffer.shape[-2]:
            self._grow(end)
        self.key_buffer[..., self.length:end, :].copy_(key_states)
        self.value_buffer[..., self.length:end, :].copy_(value_states)
        self._fill_to(end)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes the negative number of tokens to remove, got {tokens_to_remove}")
        if self.is_initialized and tokens_to_remove:
            self._fill_to(max(0, self.length + tokens_to_remove))

    def reset(self) -> None:
        """Empty, keeping the buffers for the next section."""
        if self.is_initialized:
            self._fill_to(0)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a preallocated cache holds one sequence; the engine decodes greedily")

    batch_select_indices = reorder_cache = batch_repeat_interleave  # type: ignore[assignment]

    def _fill_to(self, end: int) -> None:
        assert self.key_buffer is not None and self.value_buffer is not None
        self.length = end
        self.keys = self.key_buffer[..., :end, :]
        self.values = self.value_buffer[..., :end, :]

    def _grow(self, needed: int) -> None:
        assert self.key_buffer is not None and self.value_buffer is not None
        capacity = max(needed, 2 * self.key_buffer.shape[-2])
        for name in ("key_buffer", "value_buffer"):
            old = getattr(self, name)
            new = _buffer_like(old, capacity)
            new[..., :self.length, :].copy_(old[..., :self.length, :])
            setattr(self, name, new)
        self.capacity = capacity


def preallocate(cache: Cache, capacity: int) -> Cache:
    """`cache` with each plain attention layer replaced by one written in place, `capacity` tokens long.
    Sliding-window and recurrent layers keep their own kind: they are bounded already."""
    if capacity < 1:
        raise ValueError(f"a cache's capacity must be positive, got {capacity}")
    layers = getattr(cache, "layers", None)
    if layers is not None:
        layers[:] = [PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in layers]
    return cache


def _buffer_like(states: torch.Tensor, capacity: int) -> torch.Tensor:
    return states.new_empty(*states.shape[:-2], capacity, states.shape[-1])
