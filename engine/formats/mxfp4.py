"""Routed experts stored in MXFP4, as gpt-oss checkpoints hold them (`quantization_config.quant_method = "mxfp4"`).

Each experts parameter P of shape (E, K, N) (gpt-oss keeps its experts transposed, input dimension first) is
stored as two uint8 tensors: `P_blocks` (E, N, K/32, 16), sixteen bytes holding 32 FP4 (E2M1) values two to a
byte, the low nibble first, and `P_scales` (E, N, K/32), one power-of-two exponent per 32 values, biased by
127. The values are transformers' own dequantization (integrations/mxfp4.py) applied to one expert at a time, so
an expert read here is bit for bit the one `from_pretrained` dequantizes.
"""

from __future__ import annotations

import re

import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

MXFP4 = "mxfp4"
BLOCK_BYTES = 16
BLOCK_VALUES = 2 * BLOCK_BYTES  # two FP4 values a byte
BLOCKS, SCALES = "blocks", "scales"
_STORED = re.compile(rf"^(?P<parameter>.*\.experts\.[^.]+)_(?P<part>{BLOCKS}|{SCALES})$")


def stored_part(name: str) -> tuple[str, str] | None:
    """(the parameter's checkpoint name, "blocks" or "scales") for a tensor that stores part of an MXFP4 experts
    parameter by its name; None for any other."""
    found = _STORED.match(name)
    return (found["parameter"], found["part"]) if found else None


def dequantized_shape(blocks_shape: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """The (E, N, K) of the values an (E, N, K/32, 16) blocks tensor holds: one (out, in) matrix per expert."""
    if len(blocks_shape) < 2 or blocks_shape[-1] != BLOCK_BYTES:
        raise ValueError(f"MXFP4 blocks are (…, groups, {BLOCK_BYTES}) bytes, not {list(blocks_shape)}")
    return (*blocks_shape[:-2], blocks_shape[-2] * BLOCK_VALUES)


def dequantize_expert(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One expert's (K, N) weight, as its experts parameter holds it, from its (N, K/32, 16) blocks and (N, K/32)
    scales, in `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.ndim != 3 \
            or tuple(blocks.shape) != (*scales.shape, BLOCK_BYTES):
        raise ValueError(f"an expert's MXFP4 blocks and scales are uint8 (N, G, {BLOCK_BYTES}) and (N, G), not "
                         f"{blocks.dtype} {tuple(blocks.shape)} and {scales.dtype} {tuple(scales.shape)}")
    # transformers' function takes the experts dimension first: a batch of one
    return convert_moe_packed_tensors(blocks[None], scales[None], dtype=dtype)[0]
