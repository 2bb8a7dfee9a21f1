"""One weight stored in a GGUF file's block type, in the engine's form: float, int8 or int4 (quantize.py).

A GGUF row of K weights is K/32 (or K/256) blocks of bytes. The block types the engine's formats express map
straight into them, from the codes, with no float copy of the weight:

- Q4_0 (f16 d, 16 bytes of codes: w = (q − 8)·d) and Q4_1 (f16 d and m: w = q·d + m) are int4 groups of 32:
  scale d, zero 0 resp. m + 8·d, both rounded to the bf16 that int4 stores them in. A block's byte j holds
  codes j (low nibble) and j + 16 (high), which are re-paired as the engine's (2j, 2j + 1).
- Q4_K super-blocks of 256 (f16 d and dmin, twelve bytes holding eight 6-bit scales sc and mins m, 128 bytes of
  codes) are eight int4 groups of 32: w = q·(d·sc) − dmin·m, so scale d·sc and zero 8·d·sc − dmin·m, rounded to
  bf16 (the only error: d·sc has up to 17 significant bits, bf16 keeps 8). Byte j of each 32-byte chunk c holds
  code j of sub-block 2c (low nibble) and of 2c + 1 (high).
- Q8_0 (f16 d, 32 int8 codes: w = q·d) and Q8_K (f32 d, 256 int8 codes, then sums llama.cpp keeps for its own
  kernels) have a scale per block, int8 one per row: their codes are rescaled to the row's scale, a few rows at a
  time, which adds at most half a step of that scale (the only lossy step).

F32, F16 and BF16 stay float. Every other type is dequantized by the gguf package, one weight (one expert) at a
time, and quantized again into the format asked for: Q5_K's codes have 5 bits and Q6_K's 6 (in sub-blocks of 16),
more than int4 holds, and int8's one scale per row cannot express their per-block scales; likewise Q5_x, Q2_K,
Q3_K and the IQ types. `CONVERSIONS` counts which way each weight went, `SECONDS` the time each way took.
"""

from __future__ import annotations

import re
import time
from collections import Counter

import gguf
import numpy as np
import torch

from .quantize import INT4, INT4_GROUP, INT8, QuantizedWeight, quantize

Q = gguf.GGMLQuantizationType
Q4_0, Q4_1, Q4_K, Q8_0, Q8_K = Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0, Q.Q8_K
FLOATS = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
MAPPED, FLOAT, DEQUANTIZED = "mapped", "float", "dequantized"
CONVERSIONS: Counter[str] = Counter()  # weights converted each way since the process started
SECONDS: Counter[str] = Counter()  # the time those conversions took, each way
ROWS_AT_ONCE = 64  # Q8_0 and Q8_K rows rescaled at once: the float temporaries stay a few of the weight's rows
INT4_BITS = 4 + 2 * 16 / INT4_GROUP  # bits a weight in int4: the code, and a bf16 scale and zero per group
_Q8_SCALES = {Q8_0: torch.float16, Q8_K: torch.float32}  # the dtype of the scale that starts each int8 block
_FILE_TYPE_BITS = re.compile(r"Q(\d)_|FP(\d)")  # LlamaFileType names: MOSTLY_Q4_K_M, MOSTLY_IQ2_XS, MOSTLY_MXFP4_MOE


def direct_format(ggml_type: int) -> str | None:
    """The engine's format this block type maps into without dequantizing; None when there is none."""
    return {Q4_0: INT4, Q4_1: INT4, Q4_K: INT4, Q8_0: INT8, Q8_K: INT8}.get(ggml_type)


def stored_format(ggml_type: int) -> str | None:
    """The engine's narrowest format that keeps a weight stored in this block type without widening it much: int4
    (5 bits a weight, its scale and zero included) for types of at most 5 bits (Q4_0, Q4_1, Q4_K, Q3_K, Q2_K,
    the 4-bit IQ types), int8 for the wider ones (Q5_x, Q6_K, Q8_0); None for the float types."""
    if ggml_type in FLOATS:
        return None
    block, size = gguf.GGML_QUANT_SIZES[Q(ggml_type)]
    return INT4 if size * 8 / block <= INT4_BITS else INT8


def file_type_format(file_type: int) -> str | None:
    """The engine's format for a file llama.cpp quantized as `file_type` (its `general.file_type`): int4 for the
    types of 4 bits and fewer (Q4_K_M, Q4_0, IQ3_M, MXFP4_MOE...), int8 for 5 bits and more; None for the float
    types and a type this gguf package does not know. A file's type says what its maker asked for where its block
    types cannot: llama-quantize stores a weight whose rows are not whole super-blocks of 256 in a wider type (a
    Q4_K_M file's experts over a width of 576 in Q5_0), and keeps some down projections in Q6_K."""
    try:
        name = gguf.LlamaFileType(file_type).name
    except ValueError:
        return None
    bits = _FILE_TYPE_BITS.search(name)
    if bits is None:  # F32, F16, BF16, GUESSED
        return None
    return INT4 if int(bits[1] or bits[2]) <= 4 else INT8


def engine_weight(raw: torch.Tensor, ggml_type: int, k: int, format: str | None,
                  dtype: torch.dtype) -> torch.Tensor | QuantizedWeight:
    """The (N, K) weight whose GGUF bytes are `raw` (N, row bytes, uint8), in `format` (None: float in `dtype`)."""
    start = time.perf_counter()
    way, weight = _converted(raw, ggml_type, k, format, dtype)
    CONVERSIONS[way] += 1
    SECONDS[way] += time.perf_counter() - start
    return weight


def _converted(raw: torch.Tensor, ggml_type: int, k: int, format: str | None,
               dtype: torch.dtype) -> tuple[str, torch.Tensor | QuantizedWeight]:
    if format is not None and direct_format(ggml_type) == format:
        if ggml_type in _Q8_SCALES:
            return MAPPED, _q8(raw, ggml_type, k)
        return MAPPED, _q4_k(raw, k) if ggml_type == Q4_K else _q4(raw, ggml_type, k)
    if ggml_type in FLOATS:
        w = raw.view(FLOATS[ggml_type]).reshape(raw.shape[0], k)
        return FLOAT, w.to(dtype) if format is None else quantize(w, format)
    w = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), Q(ggml_type)))
    return DEQUANTIZED, w.to(dtype) if format is None else quantize(w, format)


def conversions_since(counts: Counter[str], seconds: Counter[str]) -> str:
    """What the weights converted since CONVERSIONS and SECONDS held `counts` and `seconds` cost, in one line
    ("" when none was)."""
    done, spent = CONVERSIONS - counts, SECONDS - seconds
    ways = {MAPPED: "mapped from their blocks", FLOAT: "from float", DEQUANTIZED: "dequantized and quantized again"}
    return ", ".join(f"{done[way]} {ways[way]} in {spent[way]:.1f} s" for way in ways if done[way])


def _blocks(raw: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """(N, row bytes) -> (N, blocks, block bytes)."""
    return raw.reshape(raw.shape[0], k // gguf.GGML_QUANT_SIZES[Q(ggml_type)][0], -1)


def _scale(blocks: torch.Tensor, at: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """The float of `dtype` stored at byte `at` of each block, as float32 (N, blocks)."""
    return blocks[..., at:at + dtype.itemsize].contiguous().view(dtype)[..., 0].float()


def _int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> QuantizedWeight:
    """(N, K/2) uint8 codes in the engine's pairs and float32 (N, K/32) scale and zero as an int4 weight (scale
    and zero rounded to bf16)."""
    return QuantizedWeight(INT4, packed, scale.to(torch.bfloat16), zero.to(torch.bfloat16), INT4_GROUP)


def _paired(halves: torch.Tensor) -> torch.Tensor:
    """(..., L) uint8 of codes j (low nibble) and j + L (high) at byte j -> (..., L) of the engine's pairs: codes 2m
    (low) and 2m + 1 (high) at byte m. Worked 8 bytes at a time (uint64, little-endian as x86 and arm64 run): the
    low nibbles of its bytes 2m and 2m + 1 are one engine byte, its 4 such bytes gathered into its low half; two
    words' halves make a word of engine bytes 0..L/2, their high nibbles likewise one of bytes L/2..L. numpy:
    torch's integer bit operations measured 3-4 times slower on one thread."""
    words = halves.contiguous().numpy().view(np.uint64)
    low, high = _gathered(words & 0x0F0F0F0F0F0F0F0F), _gathered((words >> 4) & 0x0F0F0F0F0F0F0F0F)
    paired = np.concatenate((low[..., 0::2] | (low[..., 1::2] << 32), high[..., 0::2] | (high[..., 1::2] << 32)),
                            axis=-1)
    return torch.from_numpy(paired.view(np.uint8))


def _gathered(nibbles: np.ndarray) -> np.ndarray:
    """uint64 words of 8 bytes of one nibble each -> the 4 bytes of each pair's nibbles (byte 2m's low, 2m + 1's
    high) in the word's low 32 bits."""
    pairs = (nibbles | (nibbles >> 4)) & 0x00FF00FF00FF00FF
    pairs = (pairs | (pairs >> 8)) & 0x0000FFFF0000FFFF
    return (pairs | (pairs >> 16)) & 0xFFFFFFFF


def _q4(raw: torch.Tensor, ggml_type: int, k: int) -> QuantizedWeight:
    blocks = _blocks(raw, ggml_type, k)
    d = _scale(blocks, 0)
    zero = torch.zeros_like(d) if ggml_type == Q4_0 else _scale(blocks, 2) + 8 * d
    packed = blocks[..., 2 if ggml_type == Q4_0 else 4:]  # (N, G, 16): codes j and j + 16 of each block
    return _int4(_paired(packed).reshape(raw.shape[0], k // 2), d, zero)


def _q4_k(raw: torch.Tensor, k: int) -> QuantizedWeight:
    blocks = _blocks(raw, Q4_K, k)  # (N, B, 144)
    n, count = blocks.shape[:2]
    d, dmin = _scale(blocks, 0), _scale(blocks, 2)
    sc, m = _scales_and_mins(blocks[..., 4:16])  # (N, B, 8) each
    scale = d[..., None] * sc
    zero = 8 * scale - dmin[..., None] * m
    packed = blocks[..., 16:].reshape(n, count, 4, 32)  # chunk c: sub-blocks 2c (low nibbles) and 2c + 1 (high)
    return _int4(_paired(packed).reshape(n, k // 2), scale.reshape(n, -1), zero.reshape(n, -1))


def _scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., 12) bytes -> the eight 6-bit scales and mins of each Q4_K super-block (..., 8), as ggml's
    get_scale_min_k4 unpacks them: bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; scales and
    mins 4-7 keep their low 4 bits in bytes 8-11 (scale low nibble, min high) and their top 2 bits in the top 2 bits
    of bytes 0-3 (scales) and 4-7 (mins)."""
    low, high, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat((low & 0x3F, (rest & 0xF) | ((low >> 6) << 4)), dim=-1)
    mins = torch.cat((high & 0x3F, (rest >> 4) | ((high >> 6) << 4)), dim=-1)
    return scales.float(), mins.float()


def _q8(raw: torch.Tensor, ggml_type: int, k: int) -> QuantizedWeight:
    blocks = _blocks(raw, ggml_type, k)
    scale_dtype = _Q8_SCALES[ggml_type]
    d = _scale(blocks, 0, scale_dtype)
    block = gguf.GGML_QUANT_SIZES[Q(ggml_type)][0]
    start = scale_dtype.itemsize
    codes = blocks[..., start:start + block].contiguous().view(torch.int8)  # (N, blocks, block)
    rows = [quantize((part.float() * scale[..., None]).reshape(len(part), k), INT8)
            for part, scale in zip(codes.split(ROWS_AT_ONCE), d.split(ROWS_AT_ONCE), strict=True)]
    return QuantizedWeight(INT8, torch.cat([w.codes for w in rows]), torch.cat([w.scale for w in rows]))


def dequantized(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    """A tensor's GGUF bytes as numpy values: F16 and F32 as stored, every other type dequantized to float32."""
    if ggml_type in (Q.F16, Q.F32):
        return raw.view(np.float16 if ggml_type == Q.F16 else np.float32)
    return gguf.quants.dequantize(raw, Q(ggml_type))
