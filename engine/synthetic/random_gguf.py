"""A model at a real geometry as a GGUF file of random blocks: the target's true size, load, time and memory,
without its weights.

The layout is gguf_writer's (gguf names, stacked experts, llama.cpp's storage rules), taken from the family's
transformers model built on the meta device, so nothing of the model is ever in memory. Each quantized block is
drawn as it is written, a few thousand rows at a time: its codes uniform, its float16 scale drawn around the value
that gives the weight a standard deviation of 1/sqrt(fan-in) (what keeps a random model's activations of order one).
No float weight exists on the way; 1-D tensors (the norms) are ones. Random weights make meaningless text: they make
honest time and memory.

Block types: Q4_0 and Q8_0, whose blocks are a float16 scale then the codes. A Q4_K_M file (Ollama's) is made from
the Q8_0 one by llama.cpp's `llama-quantize --allow-requantize … Q4_K_M`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedTokenizerBase

from ..loading.gguf_load import GGUF_ARCHITECTURES
from .geometry import Geometry, family_config
from .gguf_writer import VALUES_AT_ONCE, GgufTensor, gguf_tensors, model_writer, write_streamed

Q4_0, Q8_0 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0
RANDOM_TYPES = {"q4_0": Q4_0, "q8_0": Q8_0}
# The standard deviation of one code drawn uniformly: Q4_0's value is (code - 8)·scale, code 0..15; Q8_0's is
# code·scale, code -128..127.
_CODE_STD = {Q4_0: math.sqrt((16**2 - 1) / 12), Q8_0: math.sqrt((256**2 - 1) / 12)}
_SCALE_BYTES = 2  # a float16 at the start of each block
_SCALE_SPREAD = (0.5, 1.5)  # each block's scale is the typical one times a uniform draw from this range
_FLOAT_DTYPES = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}


def random_gguf_layout(geometry: Geometry, qtype: gguf.GGMLQuantizationType, *, layers: int | None = None,
                       **overrides: object) -> tuple[PretrainedConfig, list[GgufTensor]]:
    """The config of the first `layers` layers (all by default) of `geometry`, with `overrides`, and the tensors its
    file holds with 2-D weights in `qtype`."""
    if qtype not in _CODE_STD:
        raise ValueError(f"random blocks are drawn for {', '.join(t.name for t in _CODE_STD)}, not {qtype.name}")
    config = family_config(geometry, layers=layers, **overrides)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return config, list(gguf_tensors(model, GGUF_ARCHITECTURES[config.model_type], qtype, qtype))


def write_random_gguf(out: Path, config: PretrainedConfig, tensors: Sequence[GgufTensor],
                      tokenizer: PreTrainedTokenizerBase | None = None, *, seed: int = 0,
                      progress: Callable[[int], None] | None = None) -> Path:
    """The model laid out by random_gguf_layout as the GGUF file `out`, every block drawn as it is written;
    `tokenizer` None: llama.cpp's "none" vocabulary (token ids only). `progress` is told the bytes of each part."""
    if tokenizer is not None and len(tokenizer) > config.vocab_size:
        raise ValueError(f"the tokenizer's {len(tokenizer)} tokens do not fit the model's vocabulary of "
                         f"{config.vocab_size}")
    generator = np.random.default_rng(seed)
    write_streamed(model_writer(out, config, tokenizer), tensors, lambda t: random_data(t, generator), progress)
    return out


def random_data(tensor: GgufTensor, generator: np.random.Generator) -> Iterator[np.ndarray]:
    """The tensor's bytes, (rows, row bytes), a few thousand rows at a time: random blocks of its type, or ones for
    a 1-D float tensor, or random float16 values for a 2-D one (rows that are not whole blocks)."""
    width = tensor.shape[-1]
    rows = math.prod(tensor.shape[:-1])
    step = max(1, VALUES_AT_ONCE // width)
    std = width**-0.5
    for first in range(0, rows, step):
        count = min(step, rows - first)
        if tensor.qtype in _CODE_STD:
            yield _random_blocks(tensor.qtype, count, width, std, generator)
        elif len(tensor.shape) == 1:
            yield np.ones(width, dtype=_FLOAT_DTYPES[tensor.qtype])
        else:
            yield (generator.standard_normal((count, width), dtype=np.float32) * std).astype(
                _FLOAT_DTYPES[tensor.qtype])


def _random_blocks(qtype: gguf.GGMLQuantizationType, rows: int, width: int, std: float,
                   generator: np.random.Generator) -> np.ndarray:
    """(rows, row bytes) of blocks with uniform codes and float16 scales around std / the code's std."""
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    shape = (rows, width // block_values, block_bytes)
    size = math.prod(shape)
    # the generator's raw 64-bit words are random bytes as they are, several times faster than drawing bytes
    blocks = generator.bit_generator.random_raw(-(-size // 8)).view(np.uint8)[:size].reshape(shape)
    scales = generator.uniform(*_SCALE_SPREAD, blocks.shape[:2]) * (std / _CODE_STD[qtype])
    blocks[..., :_SCALE_BYTES] = scales.astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)
