"""One weight stored in a GGUF file's block type, in the engine's form: float, int8 or int4 (quantize.py).

A GGUF row of K weights is K/32 (or K/256) blocks of bytes. The block types the engine's formats express map
straight into them, from the codes, with no float copy of the weight:

- Q4_0 (f16 d, 16 bytes of codes: w = (q − 8)·d) and Q4_1 (f16 d and m: w = q·d + m) are int4 groups of 32:
  scale d, zero 0 resp. m + 8·d, both rounded to the bf16 that int4 stores them in. A block's byte j holds
  codes j (low nibble) and j + 16 (high), which are re-paired as the engine's (2j, 2j + 1).
- Q8_0 (f16 d, 32 int8 codes: w = q·d) has a scale per block of 32, int8 one per row: its codes are rescaled to
  the row's scale, a few rows at a time, which adds at most half a step of that scale (the only lossy step).

F32, F16 and BF16 stay float; every other type (the K-quants, IQ types, Q5_x) is dequantized by the gguf
package, one weight at a time, and quantized again into the format asked for. `CONVERSIONS` counts which way
each weight went.
"""

from __future__ import annotations

from collections import Counter

import gguf
import numpy as np
import torch

from .quantize import INT4, INT4_GROUP, INT8, QuantizedWeight, pack_int4, quantize

Q4_0, Q4_1, Q8_0 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0
FLOATS = {gguf.GGMLQuantizationType.F32: torch.float32, gguf.GGMLQuantizationType.F16: torch.float16,
          gguf.GGMLQuantizationType.BF16: torch.bfloat16}
MAPPED, FLOAT, DEQUANTIZED = "mapped", "float", "dequantized"
CONVERSIONS: Counter[str] = Counter()  # weights converted each way since the process started
ROWS_AT_ONCE = 64  # Q8_0 rows rescaled at once: the float temporaries stay a few of the weight's rows
INT4_BITS = 4 + 2 * 16 / INT4_GROUP  # bits a weight in int4: the code, and a bf16 scale and zero per group


def direct_format(ggml_type: int) -> str | None:
    """The engine's format this block type maps into without dequantizing; None when there is none."""
    return {Q4_0: INT4, Q4_1: INT4, Q8_0: INT8}.get(ggml_type)


def stored_format(ggml_type: int) -> str | None:
    """The engine's narrowest format that keeps a weight stored in this block type without widening it much: int4
    (5 bits a weight, its scale and zero included) for types of at most 5 bits (Q4_0, Q4_1, Q4_K, Q3_K, Q2_K,
    the 4-bit IQ types), int8 for the wider ones (Q5_x, Q6_K, Q8_0); None for the float types."""
    if ggml_type in FLOATS:
        return None
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    return INT4 if size * 8 / block <= INT4_BITS else INT8


def engine_weight(raw: torch.Tensor, ggml_type: int, k: int, format: str | None,
                  dtype: torch.dtype) -> torch.Tensor | QuantizedWeight:
    """The (N, K) weight whose GGUF bytes are `raw` (N, row bytes, uint8), in `format` (None: float in `dtype`)."""
    if format is not None and direct_format(ggml_type) == format:
        CONVERSIONS[MAPPED] += 1
        return _q8_0(raw, k) if ggml_type == Q8_0 else _q4(raw, ggml_type, k)
    if ggml_type in FLOATS:
        CONVERSIONS[FLOAT] += 1
        w = raw.view(FLOATS[ggml_type]).reshape(raw.shape[0], k)
        return w.to(dtype) if format is None else quantize(w, format)
    CONVERSIONS[DEQUANTIZED] += 1
    w = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType(ggml_type)))
    return w.to(dtype) if format is None else quantize(w, format)


def _blocks(raw: torch.Tensor, k: int) -> torch.Tensor:
    """(N, row bytes) -> (N, K/32, block bytes)."""
    return raw.reshape(raw.shape[0], k // INT4_GROUP, -1)


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The f16 stored at byte `at` of each block, as float32 (N, blocks)."""
    return blocks[..., at:at + 2].contiguous().view(torch.float16)[..., 0].float()


def _q4(raw: torch.Tensor, ggml_type: int, k: int) -> QuantizedWeight:
    blocks = _blocks(raw, k)
    d = _half(blocks, 0)
    zero = torch.zeros_like(d) if ggml_type == Q4_0 else _half(blocks, 2) + 8 * d
    packed = blocks[..., 2 if ggml_type == Q4_0 else 4:]  # (N, G, 16): codes j and j + 16 of each block
    codes = torch.cat((packed & 0xF, packed >> 4), dim=2).reshape(raw.shape[0], k)
    return QuantizedWeight(INT4, pack_int4(codes), d.to(torch.bfloat16), zero.to(torch.bfloat16), INT4_GROUP)


def _q8_0(raw: torch.Tensor, k: int) -> QuantizedWeight:
    blocks = _blocks(raw, k)
    d = _half(blocks, 0)
    codes = blocks[..., 2:].contiguous().view(torch.int8)  # (N, G, 32)
    rows = [quantize((part.float() * scale[..., None]).reshape(len(part), k), INT8)
            for part, scale in zip(codes.split(ROWS_AT_ONCE), d.split(ROWS_AT_ONCE), strict=True)]
    return QuantizedWeight(INT8, torch.cat([w.codes for w in rows]), torch.cat([w.scale for w in rows]))


def dequantized(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    """A tensor's GGUF bytes as numpy values: F16 and F32 as stored, every other type dequantized to float32."""
    if ggml_type in (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32):
        return raw.view(np.float16 if ggml_type == gguf.GGMLQuantizationType.F16 else np.float32)
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(ggml_type))
