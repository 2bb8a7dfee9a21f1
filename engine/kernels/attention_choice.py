"""Which attention kernel a prefill chunk, or a decode step's one row, runs on this machine: the engine's
(attention_kernel) or torch's flash.

The engine's kernel is faster where it shares grouped KV heads and the CPU's tiles pay off, but that is measured,
not assumed from the feature list: the first chunk of each dtype and head layout on a machine times both on a
512-token chunk against 1,024 cached tokens, with all of torch's threads, and keeps the faster, through the
measured-choice mechanism (choice.py) like the experts' kernels; each first passes a probe, a shorter chunk's
attention against the float64 one within the dtype's rounding (`probe_kernels`). A decode step (one query row) is
timed the same way on one row against the same cache, a choice of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..formats.quantize import error_bound, relative_error
from ..vocabulary import CHUNK_TOKENS
from . import attention_kernel
from .choice import Accuracy, Choice, Measured, time_in_turns
from .host import cache_root

KERNELS = ("npumoe", "torch")
CHUNK, DEPTH = CHUNK_TOKENS, 1024  # what a timing run attends: a default prefill chunk against a cache this deep
# A decode step's one query row is a choice of its own: there is nothing for the engine's kernel to share a packed
# block of keys among, and its threads cost more than the row's work, so torch's kernel may win where it loses a chunk.
DECODE_ROWS = 1
PROBE_CHUNK, PROBE_DEPTH = 64, 128  # what the probe attends: the same kernels' paths, a float64 reference

CHOICES = Measured("attention", (attention_kernel.SOURCE,))

# This process's choices by everything a choice depends on. Every layer's attention asks, in every decode step: the
# measured-choice lookup (its key, the user cache's path) was ~8 % of a 135M model's decode step, a dict look-up is not.
_made: dict[tuple[object, ...], Choice] = {}


def choose(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> Choice:
    """The faster kernel here for attention of these (B, H, n, d) tensors' dtype and head layout."""
    if query.device.type == "cpu" and not attention_kernel.supports(query, key, value):  # strides: asked every call
        return Choice("torch", {}, {"npumoe": "it needs one dtype, a head size that is a multiple of 64 up to 256 "
                                              "and unit-stride rows"})
    decode = query.shape[2] == DECODE_ROWS
    held = (query.device.type, query.dtype, query.shape[1], key.shape[1], query.shape[-1], decode,
            torch.get_num_threads(), cache_root())
    choice = _made.get(held)
    if choice is None:
        choice = _made[held] = _looked_up(query, key, decode)
    return choice


def _looked_up(query: torch.Tensor, key: torch.Tensor, decode: bool) -> Choice:
    """The choice for this dtype and head layout, for a decode step's one row or a prefill chunk's rows, from the
    measured-choice mechanism: cached, or measured now."""
    why = attention_kernel.unavailable(query.dtype) if query.device.type == "cpu" else "the tensors are not on the CPU"
    if why is not None:
        return Choice("torch", {}, {"npumoe": why})
    heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[-1]
    shape = {"heads": heads, "kv_heads": kv_heads, "head_dim": dim, "body": attention_kernel.body(query.dtype)}
    rows = {"chunk": DECODE_ROWS} if decode else {}  # a prefill chunk's key is as it was before decode had one
    return CHOICES.choose(query.dtype, shape | rows, KERNELS,
                          lambda accepted: time_kernels(accepted, query.dtype, heads, kv_heads, dim, **rows),
                          threads=torch.get_num_threads(),
                          probe=lambda kernels: probe_kernels(kernels, query.dtype, heads, kv_heads, dim))


def _causal_chunk(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, chunk: int,
                  depth: int) -> tuple[torch.Tensor, ...]:
    """Random (query, key, value) of a causal `chunk`-query chunk at `depth`, its key ranges (lo, hi) and mask."""
    generator = torch.Generator().manual_seed(0)
    keys = depth + chunk
    query = torch.randn(1, heads, chunk, head_dim, generator=generator).to(dtype)
    key = torch.randn(1, kv_heads, keys, head_dim, generator=generator).to(dtype)
    value = torch.randn(1, kv_heads, keys, head_dim, generator=generator).to(dtype)
    hi = torch.arange(depth + 1, keys + 1)
    mask = (torch.arange(keys)[None, :] < hi[:, None])[None, None]
    return query, key, value, torch.zeros_like(hi), hi, mask


def _attend(kernel: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lo: torch.Tensor,
            hi: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The chunk's attention by `kernel`, (B, n, Hq, d) as the engine's kernel gives it."""
    if kernel == "npumoe":
        return attention_kernel.attend(query, key, value, lo, hi, scale=query.shape[-1] ** -0.5)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                          enable_gqa=key.shape[1] != query.shape[1]).transpose(1, 2)


def probe_kernels(kernels: Sequence[str], dtype: torch.dtype, heads: int, kv_heads: int,
                  head_dim: int) -> dict[str, Accuracy]:
    """Each kernel's relative error on a PROBE_CHUNK-query chunk at PROBE_DEPTH against torch's attention in
    float64, and the dtype's bound."""
    query, key, value, lo, hi, mask = _causal_chunk(dtype, heads, kv_heads, head_dim, PROBE_CHUNK, PROBE_DEPTH)
    exact = _attend("torch", query.double(), key.double(), value.double(), lo, hi, mask)
    return {kernel: Accuracy(relative_error(_attend(kernel, query, key, value, lo, hi, mask), exact),
                             error_bound(dtype)) for kernel in kernels}


def time_kernels(kernels: Sequence[str], dtype: torch.dtype, heads: int, kv_heads: int,
                 head_dim: int, chunk: int = CHUNK) -> dict[str, float]:
    """Median seconds of one causal `chunk`-query chunk at DEPTH for each kernel, timed in turns."""
    chunk = _causal_chunk(dtype, heads, kv_heads, head_dim, chunk, DEPTH)
    return time_in_turns(kernels, 1, lambda kernel, _: _attend(kernel, *chunk))
