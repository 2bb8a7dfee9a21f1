"""What the Neural Engine accepts: the ops it rejects, its tensor limits, and a checker for MIL functions.

Core ML runs any op the Neural Engine rejects on the CPU instead, silently, paying a device switch
each way; so a group graph that should live on the Neural Engine must hold none of them. Apple
publishes no list: each entry below names the public source it comes from.
"""

from __future__ import annotations

from typing import Any

from ...moe.grouped import ANE_MAX_CHANNELS
from .env import import_coremltools

# hollance/neural-engine, docs/unsupported-layers.md ("Problematic layers"): gather, dilated
# convolutions, RNN layers, custom layers.
_HOLLANCE = "hollance/neural-engine docs/unsupported-layers.md"
# ane-guide.readthedocs.io, part 1 ch. 4 "Capability surface": no hardware path for reduce_prod,
# the scatter family or the recurrent cells.
_ANE_GUIDE = "ane-guide.readthedocs.io ch. 4 'Capability surface'"
# ane-guide.readthedocs.io, appendix B: the Neural Engine's sort and top-k units are native layers
# "the conversion path never emits", so Core ML's topk/argsort run elsewhere.
_ANE_GUIDE_B = "ane-guide.readthedocs.io appendix B 'Hidden-layer catalog'"
# Apple engineer on developer.apple.com/forums/thread/724930: the Neural Engine runs only the
# shapes known when the model is compiled; data-dependent shapes and control flow have none.
_STATIC_ONLY = "developer.apple.com/forums/thread/724930 (static shapes only)"

ANE_REJECTED_OPS: dict[str, str] = {
    "gather": _HOLLANCE,
    "gather_nd": _HOLLANCE,
    "gather_along_axis": _HOLLANCE,
    "scatter": _ANE_GUIDE,
    "scatter_nd": _ANE_GUIDE,
    "scatter_along_axis": _ANE_GUIDE,
    "reduce_prod": _ANE_GUIDE,
    "lstm": _HOLLANCE,
    "gru": _HOLLANCE,
    "rnn": _HOLLANCE,
    "topk": _ANE_GUIDE_B,
    "argsort": _ANE_GUIDE_B,
    "non_zero": _STATIC_ONLY,
    "while_loop": _STATIC_ONLY,
    "cond": _STATIC_ONLY,
}

# coremltools guide, "optimize.coreml API Overview": compressed weights are expanded back to float when the model
# is loaded or run, and every op still computes in float, so the ops that hold them are weights, not work placed
# on a device. Its performance guide adds that block-wise scales pay on the GPU and recommends per-channel scales
# for the Neural Engine: where a block-wise (int4) graph's convolutions run is read from the compute plan on the Mac.
_COMPRESSION = "coremltools guide 'optimize.coreml API Overview' (expanded to float at load or prediction)"
ANE_WEIGHT_OPS: dict[str, str] = {
    "constexpr_affine_dequantize": _COMPRESSION,  # int8 / uint8 with scale and zero point (iOS 16 opset)
    "constexpr_blockwise_shift_scale": _COMPRESSION,  # int4 / int8 with per-channel or per-block scales (iOS 18)
    "constexpr_lut_to_dense": _COMPRESSION,  # palettized: indices into a lookup table
    "constexpr_sparse_to_dense": _COMPRESSION,  # pruned: a mask and the kept values
}
_WEIGHT_OP_PREFIX = "constexpr_"  # every op that makes a weight when the model loads

# ANEMLL's ANE implementation notes, "Tensor Shape Constraints": rank <= 4 (N, C, H, W),
# height and width <= 16,384, channels <= 65,536 (the latter shared with the graph's splitting).
ANE_MAX_RANK = 4
ANE_MAX_SPATIAL = 16384
# Apple, "Deploying Transformers on the Apple Neural Engine" (machinelearning.apple.com, 2022), principle 1:
# the last axis of a Neural Engine buffer is padded to a multiple of 64 bytes, so a shorter one costs as much
# as the padded one anyway. The group graphs' last axis is the capacity: 32 fp16 values.
ANE_ROW_BYTES = 64
ANE_CAPACITY_MULTIPLE = ANE_ROW_BYTES // 2


def ane_problems(function: Any, inputs: tuple[str, ...] = ("x",), outputs: tuple[str, ...] = ("y",)) -> list[str]:
    """Why a MIL function would not run whole on the Neural Engine as the executor calls it; [] if it would.

    Checks that its inputs and outputs are the named static fp16 tensors, that it holds no rejected
    op, no dilated convolution and no compressed-weight op it has no source for, and that every tensor
    computed at run time fits the rank and dimension limits (weights, plain or compressed, are not).
    """
    types = import_coremltools().converters.mil.mil.types
    problems = []
    for kind, expected, found in (("inputs", list(inputs), list(function.inputs)),
                                  ("outputs", list(outputs), [v.name for v in function.outputs])):
        if found != expected:
            problems.append(f"{kind} are named {found}, expected {expected}")
    for var in [*function.inputs.values(), *function.outputs]:
        if types.builtin_to_string(var.dtype) != "fp16":
            problems.append(f"{var.name} is {types.builtin_to_string(var.dtype)}, not fp16")
    for op in _operations(function):
        if op.op_type in ANE_REJECTED_OPS:
            problems.append(f"op {op.name} is {op.op_type}, which the Neural Engine rejects "
                            f"({ANE_REJECTED_OPS[op.op_type]})")
        if op.op_type == "conv" and any(d != 1 for d in op.dilations.val):
            problems.append(f"op {op.name} is a dilated convolution ({_HOLLANCE})")
        if op.op_type.startswith(_WEIGHT_OP_PREFIX) and op.op_type not in ANE_WEIGHT_OPS:
            problems.append(f"op {op.name} is {op.op_type}, a compressed-weight op this checker knows no source "
                            f"for: whether the Neural Engine takes it is unknown")
        if op.op_type != "const" and op.op_type not in ANE_WEIGHT_OPS:
            problems += [p for var in op.outputs for p in _shape_problems(var, types)]
    return problems


def _operations(function: Any) -> list[Any]:
    """Every op of a function, including those in nested blocks."""
    found, blocks = [], [function]
    while blocks:
        for op in blocks.pop().operations:
            found.append(op)
            blocks.extend(op.blocks)
    return found


def _shape_problems(var: Any, types: Any) -> list[str]:
    if not types.is_tensor(var.sym_type):
        return []
    shape = var.shape
    if types.symbolic.any_symbolic(shape):
        return [f"{var.name} has a dynamic shape {shape}"]
    if len(shape) > ANE_MAX_RANK:
        return [f"{var.name} has rank {len(shape)} > {ANE_MAX_RANK}"]
    problems = []
    if len(shape) >= 3 and shape[-3] > ANE_MAX_CHANNELS:
        problems.append(f"{var.name} has {shape[-3]} channels > {ANE_MAX_CHANNELS}")
    if any(d > ANE_MAX_SPATIAL for d in shape[-2:]):
        problems.append(f"{var.name} has a spatial extent over {ANE_MAX_SPATIAL}: {shape}")
    return problems
