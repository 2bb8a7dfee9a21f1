"""The formats a Core ML group package holds its expert weights in, and compressing a converted program into one.

fp16 keeps the weights as conversion wrote them. int8 quantizes each convolution weight linearly and
symmetrically to int8 with one scale per output channel; int4 to int4 with one scale per block of 32
input channels of an output channel (block-wise scales are Core ML's iOS 18 / macOS 15 opset, which
the multifunction packages target anyway). Only the weights shrink: Core ML expands them back to fp16
when it loads or runs the program, and every op still computes in fp16 (coremltools guide, "optimize.coreml
API Overview"). Compression rewrites each weight `const` into an integer `const` and a
`constexpr_blockwise_shift_scale` op that scales it back.
"""

from __future__ import annotations

from typing import Any

from ...vocabulary import INT4, INT8
from .env import import_coremltools

FP16 = "fp16"
PACKAGE_FORMATS = (FP16, INT8, INT4)
INT4_BLOCK = 32  # input channels sharing one int4 scale
SCALE_BYTES = 2  # scales are fp16
# Bytes one weight value takes on disk in each format, its share of the scales included (int8 has one scale per
# output row of at least hundreds of values, so its share is left out): how full a package is.
WEIGHT_BYTES = {FP16: 2.0, INT8: 1.0, INT4: 0.5 + SCALE_BYTES / INT4_BLOCK}


def package_format(weights: str | None) -> str:
    """The package format a `[model] weights` setting runs its Core ML graphs in: int8 and int4 their own, the
    float formats (and no setting) fp16, which is what the Neural Engine computes in."""
    return weights if weights in (INT8, INT4) else FP16


def check_format(weights_format: str) -> None:
    if weights_format not in PACKAGE_FORMATS:
        raise ValueError(f"Core ML package format must be one of {', '.join(PACKAGE_FORMATS)}, "
                         f"got {weights_format!r}")


def compress(model: Any, weights_format: str) -> Any:
    """`model` (a converted ML Program) with its convolution weights stored in `weights_format`; as it is for fp16."""
    check_format(weights_format)
    if weights_format == FP16:
        return model
    cto = import_coremltools().optimize.coreml
    if weights_format == INT8:
        config = cto.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int8", granularity="per_channel",
                                             weight_threshold=0)
    else:
        config = cto.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int4", granularity="per_block",
                                             block_size=INT4_BLOCK, weight_threshold=0)
    # weight_threshold 0: every convolution weight, however small (1-D tensors, the biases, are never compressed)
    return cto.linear_quantize_weights(model, cto.OptimizationConfig(op_type_configs={"conv": config}))


def uncompressed_convolutions(function: Any) -> list[str]:
    """The convolutions of a MIL function whose weight is still a plain float constant. coremltools skips a weight
    it cannot compress as asked (int4 needs input channels in whole blocks) without saying so."""
    return [op.name for op in function.operations if op.op_type == "conv" and op.weight.op.op_type == "const"]
