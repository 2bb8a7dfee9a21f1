"""The placement check off a Mac: counting a compute plan's ops per device, and `npumoed doctor`'s totals.

Reading a real compute plan needs macOS (test_coreml_macos.py); here the counting runs on an object shaped
like coremltools' `MLComputePlan`, and doctor on costs as a Mac would have cached them.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

from click.testing import CliRunner

from npumoe.daemon.cli import main
from npumoe.engine.backends.coreml.compute_plan import count_ops
from npumoe.engine.plan.cost import CostModel
from npumoe.engine.plan.cost_cache import CostCache
from npumoe.engine.plan.residency import GroupMeasure, MeasuredCosts


@dataclass
class Op:
    operator_name: str
    device: str
    blocks: list = field(default_factory=list)


@dataclass
class Block:
    operations: list


@dataclass
class Function:
    block: Block


class FakeComputePlan:
    """model_structure.program.functions and per-op device usage, as MLComputePlan gives them."""

    def __init__(self, functions: dict[str, Function]) -> None:
        self.model_structure = type("Structure", (), {"program": type("Program", (), {"functions": functions})})
        self.asked: list[str] = []

    def get_compute_device_usage_for_mlprogram_operation(self, op: Op):
        self.asked.append(op.operator_name)
        return None if op.device == "unknown" else type("Usage", (), {"preferred_compute_device": op.device})


def test_count_ops_counts_each_functions_ops_on_the_neural_engine_nested_blocks_too():
    nested = Op("cond", "cpu", blocks=[Block([Op("conv", "ane"), Op("mul", "cpu")])])
    plan = FakeComputePlan({
        "layer0_g0_c32": Function(Block([Op("const", "ane"), Op("conv", "ane"), Op("silu", "ane"), Op("conv", "ane")])),
        "layer0_g1_c32": Function(Block([Op("conv", "ane"), nested, Op("mul", "unknown")])),
    })
    counts = count_ops(plan, lambda device: device == "ane")
    assert counts == {"layer0_g0_c32": (3, 3), "layer0_g1_c32": (2, 5)}  # consts carry no work; unknown is off
    assert "const" not in plan.asked


def test_doctor_prints_the_placement_totals_of_the_measured_graphs(home: Path, tmp_path: Path, coreml_plan) -> None:
    _, plan = coreml_plan()
    cost = CostModel(launch_s=1e-4, static_flops=1e12, cpu_call_s=1e-5, cpu_flops=1e10)
    groups = {"0/0": GroupMeasure(1e-4, device_ops=12, ops=12), "0/1": GroupMeasure(1e-4, device_ops=3, ops=12)}
    CostCache(home / "costs").put("coreml", plan, MeasuredCosts(cost, 64, 32, "coreml on a Mac", groups))
    result = CliRunner().invoke(main, ["doctor", "--json"])
    check = next(c for c in json.loads(result.stdout)["checks"] if c["check"] == "Neural Engine placement")
    assert check["status"] == "warn"
    assert check["detail"].startswith("15 of 24 ops on the Neural Engine (62%) over 2 group graphs; 1 graphs have")
