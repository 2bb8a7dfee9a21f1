"""Core ML packages with compressed expert weights (int8 per channel, int4 in blocks of 32): smaller on disk, holding
the compression ops coremltools writes, kept apart from fp16 builds, and chosen by the engine's weights setting.
Runs on Linux: conversion and compression work everywhere, only prediction needs macOS (see the end)."""

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from npumoe.daemon.cli import main
from npumoe.engine.api import EngineSettings
from npumoe.engine.backends.base import BackendOptions, GroupSpec, TorchStaticBackend
from npumoe.engine.backends.coreml import compress as compress_module
from npumoe.engine.backends.coreml.ane import ane_problems
from npumoe.engine.backends.coreml.backend import CoreMLBackend, CoreMLGroupGraph
from npumoe.engine.backends.coreml.cache import Manifest, build_folder, compiled_groups, read_manifest
from npumoe.engine.backends.coreml.compress import FP16, INT4_BLOCK, package_format
from npumoe.engine.backends.coreml.convert import ConversionError, GroupGraph, build_packages, convert_group
from npumoe.engine.backends.coreml.env import coreml_availability, coremltools_version, import_coremltools
from npumoe.engine.backends.registry import get_backend
from npumoe.engine.moe.experts_layout import DEFAULT_LAYOUT, ExpertWeights
from npumoe.engine.vocabulary import BF16, COREML, FP32, INT4, INT8

ct = import_coremltools()
types = ct.converters.mil.mil.types

HIDDEN, FFN, EXPERTS = 128, 64, 8  # whole int4 blocks on both input axes (128 and 64 input channels)
GROUPS = [GroupGraph(layer=0, capacity=32, experts=(0, 1, 2, 3)),
          GroupGraph(layer=0, capacity=64, experts=(4, 5, 6, 7))]
FORMATS = (FP16, INT8, INT4)


def random_experts(seed: int = 0) -> ExpertWeights:
    generator = torch.Generator().manual_seed(seed)
    return ExpertWeights(torch.randn(EXPERTS, 2 * FFN, HIDDEN, generator=generator) / HIDDEN**0.5,
                         torch.randn(EXPERTS, HIDDEN, FFN, generator=generator) / FFN**0.5)


def weight_bytes(package: Path) -> int:
    """The bytes of a package's weights folder (weight.bin): what compression shrinks."""
    return sum(f.stat().st_size for f in (package / "Data" / "com.apple.CoreML" / "weights").rglob("*") if f.is_file())


def package_functions(path: Path) -> dict[str, Any]:
    """Every function of a saved package, read back from disk into MIL (weights included)."""
    from coremltools.converters.mil.frontend.milproto.load import load

    spec = ct.utils.load_spec(str(path))
    return dict(load(spec, spec.specificationVersion, ct.models.utils._try_get_weights_dir_path(str(path))).functions)


def conv_weights(function: Any) -> list[tuple[Any, Any]]:
    """(each convolution's weight-making op, the weight as the program computes it) in program order."""
    found = []
    for op in function.operations:
        if op.op_type != "conv":
            continue
        source = op.weight.op
        if source.op_type == "const":
            found.append((source, op.weight.val.astype(np.float32)))
        else:  # constexpr_blockwise_shift_scale: integer data times a scale per channel or per block of channels
            data, scale = source.data.val.astype(np.float32), source.scale.val.astype(np.float32)
            found.append((source, data * np.repeat(scale, data.shape[1] // scale.shape[1], axis=1)))
    return found


def expanded_experts(function: Any) -> ExpertWeights:
    """The experts' weights as a program of GROUPS expands them: its gate, up and down convolutions, in that order
    (one convolution each: GroupedExperts' "ane" layout for these narrow experts), as the engine holds them."""
    gate, up, down = (torch.from_numpy(weight[..., 0, 0]) for _, weight in conv_weights(function))
    n = len(gate) // FFN
    return ExpertWeights(torch.cat([gate.reshape(n, FFN, HIDDEN), up.reshape(n, FFN, HIDDEN)], dim=1),
                         down.reshape(n, HIDDEN, FFN))


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Manifest]]:
    """One build of GROUPS per format under one cache root, in the folders the cache gives each format."""
    root = tmp_path_factory.mktemp("compiled")
    weights = random_experts()
    built = {}
    for weights_format in FORMATS:
        folder = build_folder(root, "random", "p0", coremltools_version(), weights_format)
        manifest = build_packages(GROUPS, lambda _: weights, DEFAULT_LAYOUT, folder, model="random", digest="p0",
                                  weights_format=weights_format)
        built[weights_format] = (folder, manifest)
    return built


def test_compressed_packages_hold_a_fraction_of_the_fp16_weight_bytes(builds: dict) -> None:
    sizes = {f: sum(weight_bytes(folder / p) for p in manifest.package_bytes) for f, (folder, manifest)
             in builds.items()}
    assert sizes[FP16] >= 3 * EXPERTS * HIDDEN * FFN * 2  # every expert's three matrices in fp16
    assert sizes[INT8] <= 0.55 * sizes[FP16]
    assert sizes[INT4] <= 0.30 * sizes[FP16]
    for weights_format, (folder, manifest) in builds.items():
        assert manifest.weights == weights_format
        for package in manifest.package_bytes:  # one target for all: multifunction packages and int4 blocks need it
            assert ct.utils.load_spec(str(folder / package)).specificationVersion == ct.target.macOS15.value


def test_compressed_programs_store_integer_weights_with_their_scales(builds: dict) -> None:
    folder, manifest = builds[FP16]
    reference = {g.function: conv_weights(package_functions(folder / g.package)[g.function]) for g in manifest.groups}
    assert all(source.op_type == "const" for convs in reference.values() for source, _ in convs)
    for weights_format, dtype, max_error in ((INT8, "int8", 0.02), (INT4, "int4", 0.12)):
        folder, manifest = builds[weights_format]
        for group in manifest.groups:
            function = package_functions(folder / group.package)[group.function]
            convs = conv_weights(function)
            assert len(convs) == len(reference[group.function]) == 3  # gate, up, down
            for (source, weight), (_, float_weight) in zip(convs, reference[group.function], strict=True):
                assert source.op_type == "constexpr_blockwise_shift_scale"
                assert types.builtin_to_string(source.data.dtype) == dtype
                rows, inputs = weight.shape[:2]
                blocks = 1 if weights_format == INT8 else inputs // INT4_BLOCK  # per channel; per block of 32
                assert source.scale.val.shape == (rows, blocks, 1, 1)
                assert np.linalg.norm(weight - float_weight) / np.linalg.norm(float_weight) < max_error
            assert ane_problems(function) == []  # the compression ops are weights the checker knows


def test_the_fp16_program_expands_to_the_experts_it_was_built_from(builds: dict) -> None:
    folder, manifest = builds[FP16]  # so `expanded_experts` reads the compressed programs' weights right too
    for group in manifest.groups:
        expanded = expanded_experts(package_functions(folder / group.package)[group.function])
        original = random_experts().select(group.experts)
        for mine, theirs in ((expanded.gate_up, original.gate_up), (expanded.down, original.down)):
            torch.testing.assert_close(mine, theirs.half().float())


def test_formats_build_in_their_own_folders_and_a_backend_finds_only_its_own(builds: dict) -> None:
    folders = {f: folder for f, (folder, _) in builds.items()}
    assert len(set(folders.values())) == len(FORMATS)
    root = folders[FP16].parents[2]
    spec = GroupSpec(random_experts().select(GROUPS[0].experts), DEFAULT_LAYOUT, GROUPS[0].capacity)
    for weights_format, folder in folders.items():
        found = compiled_groups(root, coremltools_version(), weights_format)
        assert {path for path, _ in found.values()} == {folder}
        backend = CoreMLBackend(root, weights_format=weights_format)
        assert backend._find(spec)[0] == folder


def test_the_engine_weights_setting_picks_the_coreml_package_format(tmp_path: Path) -> None:
    for weights, expected in ((INT8, INT8), (INT4, INT4), (BF16, FP16), (FP32, FP16)):
        settings = EngineSettings(model="m", backend=COREML, compiled_dir=tmp_path, weights=weights)
        backend = get_backend(COREML, settings.backend_options)
        assert isinstance(backend, CoreMLBackend) and backend.weights_format == expected
    with pytest.raises(LookupError, match="compile --weights int4"):  # no int4 build there: it says which to make
        get_backend(COREML, BackendOptions(compiled_dir=tmp_path, weights=INT4))._find(
            GroupSpec(random_experts().select((0, 1)), DEFAULT_LAYOUT, 32))
    assert package_format("auto") == FP16  # auto is decided at load, before the backend is built


def test_int4_refuses_weights_it_cannot_block(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = compress_module.compress
    monkeypatch.setattr("npumoe.engine.backends.coreml.convert.compress", lambda *a: calls.append(a[1]) or real(*a))
    generator = torch.Generator().manual_seed(0)
    odd = ExpertWeights(torch.randn(2, 2 * 48, 80, generator=generator), torch.randn(2, 80, 48, generator=generator))
    with pytest.raises(ConversionError, match="int4 could not store the weights"):
        convert_group(odd, DEFAULT_LAYOUT, 32, weights_format=INT4)  # 80 and 48 input channels: no whole blocks
    assert calls == [INT4]
    convert_group(odd, DEFAULT_LAYOUT, 32, weights_format=INT8)  # per channel takes any width
    assert calls == [INT4, INT8]


def test_the_checker_names_a_compression_op_it_knows_nothing_about() -> None:
    from coremltools.converters.mil import Builder as mb

    # constexpr_cast (an fp16 weight widened to fp32 at load) is a constexpr op the checker has no source for
    @mb.program(input_specs=[mb.TensorSpec((1, 8, 1, 32), dtype=types.fp32)], opset_version=ct.target.iOS18)
    def program(x: Any) -> Any:
        weight = mb.constexpr_cast(source_val=np.ones((8, 8, 1, 1), dtype=np.float16), output_dtype="fp32",
                                   name="cast_weight")
        return mb.conv(x=x, weight=weight, name="y")

    problems = ane_problems(program.functions["main"], ("x",), ("y",))
    assert any("cast_weight is constexpr_cast" in p and "unknown" in p for p in problems), problems


def test_compile_writes_the_format_asked_for_or_configured(home: Path, tmp_path: Path) -> None:
    def compile_json(*args: str) -> dict:
        result = CliRunner().invoke(main, [*args, "compile", "--geometry", "64x8x2x32", "--json"],
                                    catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    float_build = compile_json()
    config = tmp_path / "config.toml"
    config.write_text('[model]\nweights = "int4"\n')
    int4_build = compile_json("--config", str(config))
    assert (float_build["weights"], int4_build["weights"]) == (FP16, INT4)
    assert int4_build["folder"] == float_build["folder"] + "-int4"
    assert int4_build["bytes"] < float_build["bytes"]
    assert read_manifest(Path(int4_build["folder"])).weights == INT4


@pytest.mark.slow  # calibrates, compiles and measures the tiny model end to end (about 2 minutes)
def test_prepare_for_coreml_compiles_in_the_configured_format(home: Path, tiny_model: Path, tmp_path: Path,
                                                              harbour: str) -> None:
    home.mkdir(parents=True)
    (home / "config.toml").write_text('[model]\nweights = "int8"\n')
    document = tmp_path / "harbour.txt"
    document.write_text(harbour[:2000])
    result = CliRunner().invoke(main, ["prepare", "--model", str(tiny_model), "--data", str(document),
                                       "--backend", "coreml", "--chunk", "128"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    manifests = [read_manifest(path.parent) for path in (home / "compiled").glob("*/*/*/manifest.json")]
    assert [m.weights for m in manifests] == [INT8]


# On a Mac: what the compressed packages compute. Not run on the project's Linux machines.
@pytest.mark.macos
@pytest.mark.skipif(sys.platform != "darwin", reason="Core ML predicts only on macOS")
@pytest.mark.parametrize(("weights_format", "tolerance"), [(INT8, 0.03), (INT4, 0.25)])
def test_compressed_graphs_compute_their_expanded_weights_close_to_the_fp16_ones(builds: dict, weights_format: str,
                                                                                 tolerance: float) -> None:
    """Core ML runs the weights the program expands (to fp16 compute's precision); those differ from the fp16
    ones by quantization: FFN outputs of these random experts differ by about 1 % (int8) and 18 % (int4),
    measured in torch from the programs' weights on Linux."""
    available, reason = coreml_availability()
    if not available:
        pytest.skip(reason)
    root = builds[FP16][0].parents[2]
    folder, manifest = builds[weights_format]
    weights = random_experts()
    generator = torch.Generator().manual_seed(1)
    for group in manifest.groups:
        spec = (weights.select(group.experts), DEFAULT_LAYOUT, group.capacity)
        x = torch.randn(len(group.experts), group.capacity, HIDDEN, generator=generator)
        fp16 = CoreMLBackend(root).build_group(*spec)(x)
        graph = CoreMLBackend(root, weights_format=weights_format).build_group(*spec)
        compressed = graph(x)
        assert isinstance(graph, CoreMLGroupGraph) and graph.model is not None  # Core ML ran it
        expanded = expanded_experts(package_functions(folder / group.package)[group.function])
        reference = TorchStaticBackend().build_group(expanded, DEFAULT_LAYOUT, group.capacity)(x)
        assert (compressed - reference).norm() / reference.norm() < 1e-2
        assert (compressed - fp16).norm() / fp16.norm() < tolerance
