"""Q4_K blocks written from float weights, which the gguf package reads but does not write (tests and benches).

A plain version of llama.cpp's Q4_K quantizer without its search for the best scales: each sub-block of 32 spans
its own min..max (its min no higher than 0) in 15 steps; the eight steps and mins of a super-block of 256 are
stored as 6-bit multiples of the super-block's f16 d and dmin, in ggml's layout (get_scale_min_k4), and each
weight as the nearest 4-bit code.
"""

from __future__ import annotations

import numpy as np

SUPER_BLOCK = 256
_SUB_BLOCKS = 8
_STEPS = 15
_SIX_BITS = 63


def q4_k_blocks(rows: np.ndarray) -> np.ndarray:
    """(N, K) float32 weights, K a multiple of 256 -> their Q4_K bytes (N, K / 256 · 144)."""
    n, k = rows.shape
    x = rows.reshape(n, k // SUPER_BLOCK, _SUB_BLOCKS, SUPER_BLOCK // _SUB_BLOCKS).astype(np.float32)
    low = np.minimum(x.min(axis=3), 0)
    step = (x.max(axis=3) - low) / _STEPS
    d = (step.max(axis=2) / _SIX_BITS).astype(np.float16)
    dmin = ((-low).max(axis=2) / _SIX_BITS).astype(np.float16)
    sc = _six_bits(step, d)
    m = _six_bits(-low, dmin)
    scale = d.astype(np.float32)[..., None] * sc
    offset = dmin.astype(np.float32)[..., None] * m
    safe = np.where(scale > 0, scale, 1)[..., None]
    codes = np.clip(np.rint((x + offset[..., None]) / safe), 0, _STEPS).astype(np.uint8)
    # chunk c of 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high
    chunks = codes.reshape(n, k // SUPER_BLOCK, 4, 2, 32)
    packed = (chunks[:, :, :, 0] | (chunks[:, :, :, 1] << 4)).reshape(n, k // SUPER_BLOCK, 128)
    blocks = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), _packed_scales(sc, m),
                             packed], axis=2)
    return blocks.reshape(n, -1)


def _six_bits(values: np.ndarray, unit: np.ndarray) -> np.ndarray:
    """Each of a super-block's eight values as the nearest multiple 0..63 of its f16 `unit`."""
    unit = unit.astype(np.float32)[..., None]
    return np.clip(np.rint(values / np.where(unit > 0, unit, 1)), 0, _SIX_BITS).astype(np.uint8)


def _packed_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """(..., 8) 6-bit scales and mins -> (..., 12) bytes: scales and mins 0-3 in the low 6 bits of bytes 0-3 and
    4-7, those 4-7 with their low 4 bits in bytes 8-11 (scale low, min high) and their top 2 bits in the top 2 bits
    of bytes 0-3 (scales) and 4-7 (mins)."""
    low = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    high = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    rest = (sc[..., 4:] & 0xF) | ((m[..., 4:] & 0xF) << 4)
    return np.concatenate([low, high, rest], axis=-1).astype(np.uint8)
