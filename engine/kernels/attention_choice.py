"""Which attention kernel a prefill chunk runs on this machine: the engine's (attention_kernel) or torch's flash.

The engine's kernel is faster where it shares grouped KV heads and the CPU's tiles pay off, but that is measured,
not assumed from the feature list: the first chunk of each dtype and head layout on a machine times both on a
512-token chunk against 1,024 cached tokens, with all of torch's threads, and keeps the faster, through the
measured-choice mechanism (choice.py) like the experts' kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..vocabulary import CHUNK_TOKENS
from . import attention_kernel
from .choice import Choice, Measured, time_in_turns

KERNELS = ("npumoe", "torch")
CHUNK, DEPTH = CHUNK_TOKENS, 1024  # what a timing run attends: a default prefill chunk against a cache this deep

CHOICES = Measured("attention", (attention_kernel.SOURCE,))


def choose(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> Choice:
    """The faster kernel here for attention of these (B, H, n, d) tensors' dtype and head layout."""
    why = attention_kernel.unavailable(query.dtype) if query.device.type == "cpu" else "the tensors are not on the CPU"
    if why is None and not attention_kernel.supports(query, key, value):
        why = "it needs one dtype, a head size that is a multiple of 64 up to 256 and unit-stride rows"
    if why is not None:
        return Choice("torch", {}, {"npumoe": why})
    heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[-1]
    return CHOICES.choose(query.dtype, {"heads": heads, "kv_heads": kv_heads, "head_dim": dim}, KERNELS,
                          lambda: time_kernels(query.dtype, heads, kv_heads, dim), threads=torch.get_num_threads())


def time_kernels(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> dict[str, float]:
    """Median seconds of one causal CHUNK-query chunk at DEPTH for each kernel, timed in turns."""
    generator = torch.Generator().manual_seed(0)
    keys = DEPTH + CHUNK
    query = torch.randn(1, heads, CHUNK, head_dim, generator=generator).to(dtype)
    key = torch.randn(1, kv_heads, keys, head_dim, generator=generator).to(dtype)
    value = torch.randn(1, kv_heads, keys, head_dim, generator=generator).to(dtype)
    hi = torch.arange(DEPTH + 1, keys + 1)
    lo = torch.zeros_like(hi)
    mask = (torch.arange(keys)[None, :] < hi[:, None])[None, None]

    def run(kernel: str, _: int) -> None:
        if kernel == "npumoe":
            attention_kernel.attend(query, key, value, lo, hi, scale=head_dim ** -0.5)
        else:
            F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=kv_heads != heads)

    return time_in_turns(KERNELS, 1, run)
