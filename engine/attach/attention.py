"""The engine's attention for chunked prefill, registered through transformers' attention interface.

transformers' SDPA path copies every KV head once per query head it serves (`repeat_kv`) whenever a mask
is given on the CPU, which is every chunk after the first; models whose eager attention has per-head sink
logits (gpt-oss) cannot use SDPA at all and materialise every (query, key) weight. This function runs
the CPU's fused flash-attention kernel in both cases, exactly:
- grouped KV heads are shared (`enable_gqa`, and the flash kernel takes them as they are for sinks);
- keys that the mask hides from every query of the chunk (all but the last window of a sliding-window
  layer) are cut off before the kernel, so a window's cost does not grow with the document;
- sinks: softmax over [scores, sink] equals softmax over the scores times sigmoid(logsumexp - sink),
  and the flash kernel returns the logsumexp.
Where each query sees one run of keys (causal, sliding window: any mask that is a key range per row) and the
engine's own kernel (attention_kernel) measures faster here (attention_choice), that kernel runs instead: it
reads each KV head once for all the query heads it serves and takes sinks itself.
Model code is not patched: `use_engine_attention` selects the function by name on a model whose own
attention it can stand in for, and gives back the name it replaced.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..kernels import attention_choice, attention_kernel

# The engine's function under one name per attention it stands in for, each with that attention's own masks:
# model code may edit the mask it was given (DeepSeek-V4 appends a float bias to an eager mask).
IMPLEMENTATIONS = {"sdpa": "npumoe-sdpa", "eager": "npumoe-eager"}


def engine_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, s_aux: torch.Tensor | None = None,
                     **kwargs: object) -> tuple[torch.Tensor, None]:
    """(B, Hq, n, d) queries against (B, Hkv, kv, d) keys and values -> ((B, n, Hq, dv), None)."""
    for unsupported in ("softcap", "position_bias"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"the engine's attention does not implement {unsupported}")
    rows = query.shape[2]
    causal = rows > 1 and attention_mask is None and (is_causal if is_causal is not None
                                                      else getattr(module, "is_causal", True))
    p = dropout if module.training else 0.0
    if p == 0.0 and attention_choice.choose(query, key, value).winner == "npumoe":
        ranges = key_ranges(attention_mask, rows, key.shape[2], causal)
        if ranges is not None:
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            return attention_kernel.attend(query, key, value, *ranges, scale=scale, sinks=s_aux), None
    if attention_mask is not None:
        key, value, attention_mask = _visible_keys(key, value, attention_mask)
    elif causal and key.shape[2] > rows:  # an empty preallocated cache: only the chunk's own keys exist
        key, value = key[:, :, :rows], value[:, :, :rows]
    if s_aux is None:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=p,
                                             scale=scaling, is_causal=causal, enable_gqa=key.shape[1] != query.shape[1])
    else:
        out = _with_sinks(query, key, value, attention_mask, s_aux, scaling=scaling, causal=causal)
    return out.transpose(1, 2).contiguous(), None


# The key ranges of the masks of the chunk in flight, by the mask's id: every layer of a chunk is given the same
# mask (or one of two, full and sliding-window). A tensor edited in place is read again where torch counts its
# versions; an inference tensor has no count, and the model code that edits masks makes new ones (DeepSeek-V4).
_ranges: dict[int, tuple[weakref.ref[torch.Tensor], int, tuple[torch.Tensor, torch.Tensor] | None]] = {}


def key_ranges(mask: torch.Tensor | None, rows: int, keys: int,
               causal: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per query row i, the keys [lo[i], hi[i]) it sees, where that is all a mask says; None where it says more
    (a float bias, keys hidden between seen ones, a mask per batch entry or head)."""
    if mask is None:
        hi = torch.arange(1, rows + 1) if causal else torch.full((rows,), keys)
        return torch.zeros(rows, dtype=torch.int64), hi
    version = -1 if mask.is_inference() else mask._version
    held = _ranges.get(id(mask))
    if held is not None and held[0]() is mask and held[1] == version:
        return held[2]
    for stale in [k for k, (ref, _, _) in _ranges.items() if ref() is None]:
        del _ranges[stale]
    ranges = _mask_ranges(mask, rows, keys)
    _ranges[id(mask)] = (weakref.ref(mask), version, ranges)
    return ranges


def _mask_ranges(mask: torch.Tensor, rows: int, keys: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    if mask.dim() != 4 or mask.shape[:2] != (1, 1) or mask.shape[2:] != (rows, keys) or mask.device.type != "cpu":
        return None
    if mask.dtype == torch.bool:
        visible = mask[0, 0]
    else:  # additive: 0 shows a key, the dtype's lowest value or -inf hides it; anything else is a bias
        visible = mask[0, 0] == 0
        if not bool((visible | (mask[0, 0] <= torch.finfo(mask.dtype).min)).all()):
            return None
    return attention_kernel.mask_ranges(visible)


def _visible_keys(key: torch.Tensor, value: torch.Tensor,
                  mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys, values and mask without the leading keys no query may see (a boolean mask, or an additive one
    where -inf hides), nor the trailing ones: a cache preallocated for a section's summary holds room for the
    tokens not decoded yet, which a decode step's mask hides."""
    visible = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min
    seen = visible.reshape(-1, visible.shape[-1]).any(dim=0)
    if not bool(seen.any()):
        return key, value, mask
    first, end = int(seen.int().argmax()), len(seen) - int(seen.flip(0).int().argmax())
    if first == 0 and end == len(seen):
        return key, value, mask
    return key[:, :, first:end], value[:, :, first:end], mask[..., first:end]


def _with_sinks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                sinks: torch.Tensor, *, scaling: float | None, causal: bool) -> torch.Tensor:
    """Flash attention over the scores plus one sink logit per head that takes probability but adds no value."""
    heads, rows = query.shape[1], query.shape[2]
    if mask is None and causal:  # the chunk's rows end at the last key: one (rows, keys) mask, broadcast over heads
        offset = key.shape[2] - rows
        mask = (torch.arange(rows, device=query.device)[:, None] + offset
                >= torch.arange(key.shape[2], device=query.device)[None, :])[None, None]
    if mask is not None and mask.dtype == torch.bool:  # this kernel takes an additive mask in the query's dtype
        mask = torch.zeros(mask.shape, dtype=query.dtype).masked_fill_(~mask, float("-inf"))
    # The kernel takes grouped KV heads as they are and broadcasts the mask over the heads.
    out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, attn_mask=mask,
                                                                                scale=scaling)
    logsumexp = logsumexp.reshape(*logsumexp.shape, 1)
    return (out.float() * torch.sigmoid(logsumexp - sinks.float().reshape(1, heads, 1, 1))).to(query.dtype)


def stands_in_for(model: PreTrainedModel) -> bool:
    """Whether the engine's attention computes what the model's selected attention does: SDPA, or eager
    attention that SDPA describes (models that support SDPA, and gpt-oss-style sinks)."""
    current = model.config._attn_implementation
    if current == "sdpa":
        return True
    if current != "eager":
        return False
    return bool(model._supports_sdpa) or any(hasattr(m, "sinks") for m in model.modules()
                                             if type(m).__name__.endswith("Attention"))


def use_engine_attention(model: PreTrainedModel) -> str | None:
    """Select the engine's attention on `model` where it stands in exactly; the name it replaced, or None."""
    if model.device.type != "cpu" or not stands_in_for(model):
        return None
    previous = model.config._attn_implementation
    model.set_attn_implementation(IMPLEMENTATIONS[previous])
    return previous


for _replaced, _name in IMPLEMENTATIONS.items():
    ALL_ATTENTION_FUNCTIONS.register(_name, engine_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(_name, ALL_MASK_ATTENTION_FUNCTIONS[_replaced])
