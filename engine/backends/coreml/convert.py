"""Converting a plan's static group graphs into multifunction Core ML packages for the Neural Engine.

Each group graph is `GroupedExperts` in its "ane" layout (grouped 1x1 convolutions), exported with
torch.export and converted to an fp16 ML Program function x (1, G*H, 1, C) -> y, its weights then stored in
the build's format (fp16, int8 or int4: compress.py). A group whose values would overflow fp16 is converted
scaled by s (a power of two): the host divides its input by s and multiplies its output by s, and the
graph's gate rows are multiplied by s so the gate sees what it would unscaled; the up projection, the gated
product and the output are then all s times smaller. Functions are filled into packages in (layer, group)
order, a new package starting before one would pass about 1 GB of weights in that format, so one package
holds a layer's functions, or a few small layers'.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...moe.experts_layout import GLU, ExpertsLayout, ExpertWeights
from ...moe.grouped import GroupedExperts
from ...plan.expert_plan import ExpertPlan
from ...plan.residency import Residency
from .ane import ane_problems
from .cache import INPUT_NAME, MANIFEST, OUTPUT_NAME, CompiledGroup, Manifest, weights_fingerprint
from .compress import FP16, INT4_BLOCK, WEIGHT_BYTES, check_format, compress, uncompressed_convolutions
from .env import import_coremltools

MAX_PACKAGE_BYTES = 1 << 30


@dataclass(frozen=True)
class GroupGraph:
    """A static group graph a plan asks for: these experts of this layer at capacity C, scaled by s."""

    layer: int
    capacity: int
    experts: tuple[int, ...]
    scale: float = 1.0


def plan_group_graphs(plan: ExpertPlan, residency: Residency, *, every_group: bool = False) -> list[GroupGraph]:
    """The plan's static group graphs as `residency` places them, layers numbered in plan order: the groups it
    puts on the accelerator, or with `every_group` all of them (a sizing run)."""
    return [GroupGraph(layer=i, capacity=placement.capacity, experts=group.experts, scale=placement.scale)
            for i, (layer, placements) in enumerate(zip(plan.layers, residency.layers, strict=True))
            for group, placement in zip(layer.groups, placements, strict=True)
            if placement.accelerator or every_group]


def plan_digest(plan: ExpertPlan, groups: Sequence[GroupGraph]) -> str:
    """A short digest of what a build of `groups` depends on in the plan: each group's layer, capacity, experts
    and scale. Re-calibrating into the same groups reuses the build; any change to them makes a new one."""
    graphs = [(plan.layers[g.layer].name, g.capacity, g.experts, g.scale) for g in groups]
    return hashlib.sha256(json.dumps(graphs).encode()).hexdigest()[:16]


class ConversionError(ValueError):
    """A group graph that would not run whole on the Neural Engine."""


def scaled_weights(weights: ExpertWeights, layout: ExpertsLayout, scale: float) -> ExpertWeights:
    """The weights of a graph fed x / scale whose output comes out `scale` times smaller: the gate rows (and
    gate bias) times `scale`, so the gate is unchanged, and the up and down biases divided by it. Only a plain
    GLU scales so (a clamp on the up projection, or an ungated activation, is not linear in it)."""
    if scale == 1.0:
        return weights
    if layout.gate != GLU:
        raise ConversionError(f"experts of layout {layout.describe()} cannot be scaled into fp16 range")
    inter = weights.gate_up.shape[1] // 2
    gate_up = torch.cat([weights.gate_up[:, :inter] * scale, weights.gate_up[:, inter:]], dim=1)
    gate_up_bias, down_bias = weights.gate_up_bias, weights.down_bias
    if gate_up_bias is not None:
        gate_up_bias = torch.cat([gate_up_bias[:, :inter], gate_up_bias[:, inter:] / scale], dim=1)
    if down_bias is not None:
        down_bias = down_bias / scale
    return ExpertWeights(gate_up, weights.down, gate_up_bias, down_bias)


def convert_group(weights: ExpertWeights, layout: ExpertsLayout, capacity: int, scale: float = 1.0, *,
                  weights_format: str = FP16) -> Any:
    """The fp16 ML Program (a coremltools MLModel, not loaded) of G experts' graph at capacity C: the experts'
    weights in the engine's form, computing the FFN their experts layout describes, scaled by `scale` (the
    caller divides its input by it and multiplies its output by it), its weights stored in `weights_format`."""
    if (problem := layout.coreml_problem()) is not None:
        raise ConversionError(f"experts of layout {layout.describe()} stay on the CPU: {problem}")
    check_format(weights_format)
    ct = import_coremltools()
    graph = GroupedExperts(scaled_weights(weights.to(torch.float32), layout, scale), layout, layout="ane").eval()
    example = torch.zeros(1, graph.group_size * graph.hidden_size, 1, capacity)
    with _quiet():
        exported = torch.export.export(graph, (example,)).run_decompositions({})
        model = ct.convert(
            exported,
            inputs=[ct.TensorType(INPUT_NAME, shape=example.shape, dtype=np.float16)],
            outputs=[ct.TensorType(OUTPUT_NAME, dtype=np.float16)],
            convert_to="mlprogram",
            compute_precision=ct.precision.FLOAT16,
            minimum_deployment_target=ct.target.macOS15,  # multifunction packages (and int4 blocks) need it
            skip_model_load=True,
        )
        model = compress(model, weights_format)
    function = model._get_mil_internal().functions["main"]
    if weights_format != FP16 and (left := uncompressed_convolutions(function)):
        raise ConversionError(f"{weights_format} could not store the weights of {', '.join(left)} (input channels "
                              f"{weights.hidden} and {weights.ffn}; int4 takes whole blocks of {INT4_BLOCK}): "
                              f"compile this model's packages in another format")
    problems = ane_problems(function, (INPUT_NAME,), (OUTPUT_NAME,))
    if problems:
        raise ConversionError(f"{graph.group_size} experts at capacity {capacity}: " + "; ".join(problems))
    return model


def build_packages(
    groups: Sequence[GroupGraph],
    layer_weights: Callable[[int], ExpertWeights],
    layout: ExpertsLayout,
    folder: Path,
    *,
    model: str,
    digest: str,
    weights_format: str = FP16,
    max_package_bytes: int = MAX_PACKAGE_BYTES,
    on_converted: Callable[[CompiledGroup], None] | None = None,
) -> Manifest:
    """Convert every group graph into `folder` (a build folder), its weights stored in `weights_format`, and
    return its manifest.

    `model`, `digest` (the plan's) and the format are recorded in the manifest. `layer_weights(layer)` gives that
    layer's experts' weights, all of `layout` (described in the manifest's `act`). The build is made beside
    `folder` and renamed into place once its manifest is written, so a crash never leaves a half-written
    folder that looks finished; callers hold the folder's lock (`cache.build_once`), so two builds never race.
    """
    ct = import_coremltools()
    if not groups:
        raise ValueError("the plan has no static group graphs to convert")
    first = layer_weights(groups[0].layer)
    hidden, inter = first.hidden, first.ffn
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    scratch = partial / "scratch"
    compiled: list[CompiledGroup] = []
    for package, members in _fill_packages(groups, hidden * inter * WEIGHT_BYTES[weights_format], max_package_bytes):
        scratch.mkdir(parents=True)
        functions = ct.utils.MultiFunctionDescriptor()
        for group in members:
            weights = layer_weights(group.layer).select(group.experts)
            index = sum(c.layer == group.layer for c in compiled)
            function = f"layer{group.layer}_g{index}_c{group.capacity}"
            path = scratch / f"{function}.mlpackage"
            convert_group(weights, layout, group.capacity, group.scale, weights_format=weights_format).save(str(path))
            functions.add_function(str(path), "main", function)
            compiled.append(CompiledGroup(function, package, group.layer, group.capacity, group.experts,
                                          weights_fingerprint(weights.gate_up, weights.down), group.scale))
            if on_converted:
                on_converted(compiled[-1])
        functions.default_function_name = compiled[-1].function
        with _quiet():
            ct.utils.save_multifunction(functions, str(partial / package))
        shutil.rmtree(scratch)
    sizes = {p.name: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) for p in partial.glob("*.mlpackage")}
    manifest = Manifest(model=model, plan=digest, coremltools=ct.__version__, hidden=hidden, intermediate=inter,
                        act=layout.describe(), groups=tuple(compiled), package_bytes=sizes, weights=weights_format)
    (partial / MANIFEST).write_text(manifest.to_json())
    if folder.exists():  # an unfinished build, or a finished one that is being rebuilt
        shutil.rmtree(folder)
    partial.rename(folder)
    return manifest


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Hide what conversion prints: coremltools draws a tqdm bar per pass (callers draw their own
    progress), and torch.export warns about its own deprecated internals."""
    with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec")
        yield


def _fill_packages(groups: Sequence[GroupGraph], matrix_bytes: float,
                   max_bytes: int) -> Iterator[tuple[str, list[GroupGraph]]]:
    """(package file name, its group graphs), filled in layer order up to `max_bytes` of weights each, an expert
    holding three matrices of `matrix_bytes` (gate, up and down)."""
    packages: list[list[GroupGraph]] = [[]]
    size = 0
    for group in sorted(groups, key=lambda g: g.layer):
        weight_bytes = len(group.experts) * 3 * matrix_bytes
        if packages[-1] and size + weight_bytes > max_bytes:
            packages.append([])
            size = 0
        packages[-1].append(group)
        size += weight_bytes
    for index, members in enumerate(packages):
        yield f"experts-{index:03d}.mlpackage", members
