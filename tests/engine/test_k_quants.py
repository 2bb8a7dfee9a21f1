"""The synthetic Q4_K writer: blocks the gguf package's own Q4_K reader reads back as the weights, to within a step."""

from __future__ import annotations

import gguf
import numpy as np

from npumoe.engine.synthetic.k_quants import q4_k_blocks


def test_q4_k_blocks_read_back_within_about_half_a_step_of_each_sub_block():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 512)).astype(np.float32) * np.float32(0.02)
    blocks = q4_k_blocks(w)
    assert blocks.shape == (8, 2 * gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q4_K][1])
    back = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K)
    step = np.ptp(w.reshape(8, 16, 32), axis=2) / 15  # each sub-block's range in 15 steps
    # half a step from rounding the code, a little more from storing its scale and min as 6-bit multiples
    assert (np.abs(back - w).reshape(8, 16, 32).max(axis=2) <= 0.6 * step).all()  # measured 0.505
