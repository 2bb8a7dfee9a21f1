"""Converting a tiny model's group graphs to Core ML: what lands on disk is what the Neural Engine and
the executor expect. Runs on Linux: coremltools converts and saves everywhere, it only cannot predict."""

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from npumoe.engine.backends.coreml.ane import ANE_REJECTED_OPS, ane_problems
from npumoe.engine.backends.coreml.cache import INPUT_NAME, OUTPUT_NAME, Manifest, build_folder, read_manifest
from npumoe.engine.backends.coreml.convert import ConversionError, GroupGraph, build_packages, convert_group
from npumoe.engine.backends.coreml.env import import_coremltools
from npumoe.engine.loading.load import load_model
from npumoe.engine.moe.experts_layout import DEFAULT_LAYOUT, ExpertWeights, expert_weights
from npumoe.engine.moe.model_experts import moe_layouts

ct = import_coremltools()

GROUPS = [GroupGraph(layer=0, capacity=16, experts=(3, 0, 7, 12)),
          GroupGraph(layer=0, capacity=8, experts=(1, 2)),
          GroupGraph(layer=2, capacity=16, experts=(5, 6, 30, 31))]


def package_functions(path: Path) -> dict[str, Any]:
    """Every function of a saved package, read back from disk into MIL (weights included)."""
    from coremltools.converters.mil.frontend.milproto.load import load

    spec = ct.utils.load_spec(str(path))
    program = load(spec, spec.specificationVersion, ct.models.utils._try_get_weights_dir_path(str(path)))
    return dict(program.functions)


def conv_weights(function: Any) -> list[np.ndarray]:
    return [op.weight.val for op in function.operations if op.op_type == "conv"]


@pytest.fixture(scope="module")
def tiny_weights(tiny_model: Path) -> list[ExpertWeights]:
    model = load_model(tiny_model).model
    return [expert_weights(experts, layout) for _, experts, layout in moe_layouts(model)]


@pytest.fixture(scope="module")
def built(tiny_weights: list, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest]:
    folder = tmp_path_factory.mktemp("cache") / "build"
    manifest = build_packages(GROUPS, tiny_weights.__getitem__, DEFAULT_LAYOUT, folder, model="tiny", digest="p0")
    return folder, manifest


def test_every_plan_group_becomes_one_function(built: tuple[Path, Manifest]) -> None:
    folder, manifest = built
    assert [(g.layer, g.capacity, g.experts) for g in manifest.groups] == [
        (g.layer, g.capacity, g.experts) for g in GROUPS]
    on_disk = {name for package in manifest.package_bytes for name in package_functions(folder / package)}
    assert on_disk == {g.function for g in manifest.groups}
    assert read_manifest(folder) == manifest


def test_functions_take_and_return_static_fp16_tensors_named_for_the_executor(built: tuple[Path, Manifest]) -> None:
    folder, manifest = built
    for group in manifest.groups:
        function = package_functions(folder / group.package)[group.function]
        assert list(function.inputs) == [INPUT_NAME]
        assert [v.name for v in function.outputs] == [OUTPUT_NAME]
        expected = group.input_shape(manifest.hidden)  # (1, G*H, 1, C)
        for var in (function.inputs[INPUT_NAME], function.outputs[0]):
            assert var.shape == expected
            assert ct.converters.mil.mil.types.builtin_to_string(var.dtype) == "fp16"


def test_functions_hold_no_op_the_neural_engine_rejects(built: tuple[Path, Manifest]) -> None:
    folder, manifest = built
    for package in manifest.package_bytes:
        for function in package_functions(folder / package).values():
            op_types = {op.op_type for op in function.operations}
            assert not op_types & ANE_REJECTED_OPS.keys()
            assert "conv" in op_types and "matmul" not in op_types  # the 1x1-convolution layout
            assert ane_problems(function) == []


def test_package_weights_are_the_plan_experts_weights_in_fp16(built: tuple[Path, Manifest], tiny_weights: list) -> None:
    folder, manifest = built
    for group in manifest.groups:
        gate_up, down = tiny_weights[group.layer].gate_up, tiny_weights[group.layer].down
        experts, inter, hidden = list(group.experts), manifest.intermediate, manifest.hidden
        g = len(experts)
        expected = [gate_up[experts, :inter].reshape(g * inter, hidden, 1, 1),
                    gate_up[experts, inter:].reshape(g * inter, hidden, 1, 1),
                    down[experts].reshape(g * hidden, inter, 1, 1)]
        stored = conv_weights(package_functions(folder / group.package)[group.function])
        assert len(stored) == 3
        for weight in expected:
            assert any(np.array_equal(s, weight.half().numpy()) for s in stored)


def test_packages_are_split_to_stay_under_the_size_limit(tiny_weights: list, tmp_path: Path) -> None:
    hidden, inter = tiny_weights[0].hidden, tiny_weights[0].ffn
    six_experts = 6 * 3 * hidden * inter * 2  # bytes of fp16 weights
    manifest = build_packages(GROUPS, tiny_weights.__getitem__, DEFAULT_LAYOUT, tmp_path / "build", model="tiny",
                              digest="p0", max_package_bytes=six_experts)
    packages = [g.package for g in manifest.groups]
    assert packages[0] == packages[1] != packages[2]  # layer 0's 4 + 2 experts fit; layer 2's 4 more do not
    assert all(size < six_experts + 16 * 1024 for size in manifest.package_bytes.values())  # + program text


def test_projections_wider_than_the_channel_limit_are_split_into_several_convolutions() -> None:
    hidden, inter = 64, 40000  # two experts' 2 x 40000 intermediate channels would pass 65536
    gate_up, down = torch.randn(2, 2 * inter, hidden) / 8, torch.randn(2, hidden, inter) / 200
    program = convert_group(ExpertWeights(gate_up, down), DEFAULT_LAYOUT, capacity=4)._get_mil_internal()
    function = program.functions["main"]
    op_types = [op.op_type for op in function.operations]
    assert op_types.count("conv") == 6 and "concat" in op_types  # one expert per chunk, joined on channels
    assert ane_problems(function) == []


def test_a_group_wider_than_the_channel_limit_is_refused_with_the_reason() -> None:
    gate_up, down = torch.randn(2, 2, 40000), torch.randn(2, 40000, 1)  # 2 experts x hidden 40000
    with pytest.raises(ConversionError, match="80000 channels > 65536"):
        convert_group(ExpertWeights(gate_up, down), DEFAULT_LAYOUT, capacity=1)


def test_a_capacity_beyond_the_spatial_limit_is_refused_with_the_reason() -> None:
    gate_up, down = torch.randn(1, 2, 4), torch.randn(1, 4, 1)
    with pytest.raises(ConversionError, match="spatial extent over 16384"):
        convert_group(ExpertWeights(gate_up, down), DEFAULT_LAYOUT, capacity=20000)


def test_the_checker_names_rejected_ops_dtypes_and_names() -> None:
    mb, types = ct.converters.mil.Builder, ct.converters.mil.mil.types

    @mb.program(input_specs=[mb.TensorSpec(shape=(8, 4), dtype=types.fp32)], opset_version=ct.target.macOS15)
    def program(tokens: Any) -> Any:
        return mb.gather(x=tokens, indices=np.array([0, 2], dtype=np.int32), axis=0, name="picked")

    problems = ane_problems(program.functions["main"])
    assert any("gather" in p and "hollance" in p for p in problems)
    assert any("not fp16" in p for p in problems)
    assert any("inputs are named ['tokens']" in p for p in problems)


def test_builds_are_keyed_by_model_plan_and_coremltools_version(tmp_path: Path) -> None:
    a = build_folder(tmp_path, "Qwen/Qwen3-30B-A3B@1234", "plan1", "9.0")
    assert a.relative_to(tmp_path).parts == ("Qwen_Qwen3-30B-A3B@1234", "plan1", "coremltools-9.0")
    assert build_folder(tmp_path, "Qwen/Qwen3-30B-A3B@1234", "plan2", "9.0") != a
    assert build_folder(tmp_path, "Qwen/Qwen3-30B-A3B@1234", "plan1", "9.1") != a
    assert read_manifest(a) is None  # nothing built yet
