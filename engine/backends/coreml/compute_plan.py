"""Where Core ML will run each function's operations: read from its compute plan (`MLComputePlan`).

Core ML quietly runs an op the Neural Engine cannot take on the CPU or GPU. The compute plan of a
compiled package names, for every op of every function, the device Core ML prefers for it under the
chosen compute units; counting those that prefer the Neural Engine tells whether a group graph really
lives there. Reading a compute plan needs macOS; counting works on any object shaped like one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .env import import_coremltools

# Ops that carry no work of their own: the weights, and naming an output.
_NOT_COUNTED = ("const", "identity")


def neural_engine_ops(compiled: Path, compute_units: str) -> dict[str, tuple[int, int]]:
    """function -> (ops Core ML places on the Neural Engine, ops) for the compiled package `compiled`."""
    ct = import_coremltools()
    from coremltools.models.compute_device import MLNeuralEngineComputeDevice
    from coremltools.models.compute_plan import MLComputePlan

    units = getattr(ct.ComputeUnit, compute_units.upper())
    plan = MLComputePlan.load_from_path(path=str(compiled), compute_units=units)
    return count_ops(plan, lambda device: isinstance(device, MLNeuralEngineComputeDevice))


def count_ops(plan: Any, on_engine: Any) -> dict[str, tuple[int, int]]:
    """function -> (ops whose preferred device `on_engine` accepts, ops) over a compute plan's program,
    nested blocks included; an op whose usage Core ML cannot tell counts as off the Neural Engine."""
    program = plan.model_structure.program
    if program is None:
        raise ValueError("the compiled model is not an ML Program")
    counts = {}
    for name, function in program.functions.items():
        placed = total = 0
        blocks = [function.block]
        while blocks:
            for op in blocks.pop().operations:
                blocks.extend(op.blocks)
                if op.operator_name in _NOT_COUNTED:
                    continue
                usage = plan.get_compute_device_usage_for_mlprogram_operation(op)
                total += 1
                placed += usage is not None and bool(on_engine(usage.preferred_compute_device))
        counts[name] = (placed, total)
    return counts
