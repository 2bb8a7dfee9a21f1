"""The `coreml` backend: group graphs run by Core ML on the Neural Engine, from packages `npumoed compile` built.

A group's graph is found by its weights' fingerprint, capacity and fp16 scale among the finished
builds under the cache root in the package format of the engine's weights setting (fp16, int8 or int4;
never another format's), compiled once per macOS version into an .mlmodelc beside its package, and loaded
with the configured compute units when it is first called. `time_groups` times each graph and reads
from Core ML's compute plan where its ops run, which residency then uses in place of the cost model.
Where Core ML cannot predict (Linux, macOS before 15) the backend says why, once, and runs the same
group graphs in torch (`torch-static` semantics), so any plan still runs everywhere.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import tempfile
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ...kernels.choice import median_seconds
from ...moe.dispatch import GraphCalls, GroupGraph
from ...moe.experts_layout import DEFAULT_LAYOUT, ExpertsLayout, ExpertWeights
from ...moe.grouped import from_ane_layout, to_ane_layout
from ...plan.cost import CostModel, expert_flops, fit_call_cost
from ...plan.residency import GroupMeasure
from ...vocabulary import COMPUTE_UNITS, COREML, DEFAULT_COMPUTE_UNITS
from ..base import BackendOptions, GroupSpec, TorchStaticBackend
from .ane import ANE_CAPACITY_MULTIPLE
from .cache import INPUT_NAME, OUTPUT_NAME, CompiledGroup, compiled_groups, folder_lock, weights_fingerprint
from .compress import FP16, check_format, package_format
from .compute_plan import neural_engine_ops
from .convert import convert_group
from .env import coreml_availability, coremltools_version, import_coremltools

log = logging.getLogger(__name__)

# Capacities of the two sample graphs timed for the cost model: one shows the fixed cost of a
# launch, the other the throughput.
_FIT_CAPACITIES = (8, 256)


class CoreMLGroupGraph:
    """A group function as the dispatcher's graph: (G, C, H) -> (G, C, H), one prediction per call. `load` gives
    the Core ML model; it is called on the first call, so functions a run never needs are never loaded."""

    def __init__(self, load: Callable[[], Any], n_experts: int, scale: float = 1.0) -> None:
        self.load = load
        self.model: Any = None
        self.n_experts = n_experts
        self.scale = scale  # the function computes values / scale (fp16 range): divide in, multiply out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.model is None:
            self.model = self.load()
        y = torch.from_numpy(self.model.predict({INPUT_NAME: self.input(x).numpy()})[OUTPUT_NAME])
        return from_ane_layout(y, self.n_experts).to(x.dtype) * self.scale

    def input(self, x: torch.Tensor) -> torch.Tensor:
        """(G, C, H) -> (1, G*H, 1, C) float32, divided by the scale: in one pass where unscaled. float32, not the
        function's fp16: coremltools copies an fp16 input to float32 before Core ML sees it (`MLModel.predict`,
        `_update_float16_multiarray_input_to_float32`), and Core ML rounds it to the function's fp16 itself."""
        ane = to_ane_layout(x, torch.float32)
        return ane.div_(self.scale) if self.scale != 1.0 else ane  # a power of two: exact in float32


class CoreMLBackend(TorchStaticBackend):
    name = COREML
    static = True
    capacity_multiple = ANE_CAPACITY_MULTIPLE
    fp16 = True
    graphs_from_float = True  # a group's graph is found by its float weights' fingerprint

    @classmethod
    def check(cls, options: BackendOptions) -> None:
        if options.compiled_dir is None:
            raise ValueError("the coreml backend needs compiled_dir: the folder `npumoed compile` builds graphs in")

    @classmethod
    def build(cls, options: BackendOptions) -> CoreMLBackend:
        """Core ML's backend finds its graphs under `compiled_dir`, in the package format of the weights setting
        (off macOS it warns once and runs them with torch-static)."""
        cls.check(options)
        assert options.compiled_dir is not None  # checked just above
        return cls(options.compiled_dir, options.compute_units, package_format(options.weights))

    def __init__(self, cache_root: Path, compute_units: str = DEFAULT_COMPUTE_UNITS,
                 weights_format: str = FP16) -> None:
        if compute_units not in COMPUTE_UNITS:
            raise ValueError(f"compute units must be one of {', '.join(COMPUTE_UNITS)}, got {compute_units!r}")
        check_format(weights_format)
        self.cache_root = Path(cache_root)
        self.compute_units = compute_units
        self.weights_format = weights_format  # the packages it runs: never another format's
        self.available, self.reason = coreml_availability()
        if not self.available:  # its graphs run as torch-static's: at torch-static's shapes, in its dtype
            self.capacity_multiple, self.fp16 = TorchStaticBackend.capacity_multiple, TorchStaticBackend.fp16
        self._index: dict[tuple[str, int], tuple[Path, CompiledGroup]] | None = None
        self._warned = False
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="coreml")

    def static_problem(self, layout: ExpertsLayout) -> str | None:
        return layout.coreml_problem()

    @classmethod
    def fallback_reason(cls) -> str | None:
        available, reason = coreml_availability()
        return None if available else reason

    def build_group(self, weights: ExpertWeights, layout: ExpertsLayout, capacity: int,
                    scale: float = 1.0) -> GroupGraph:
        if not self.available:
            self._warn_fallback()
            return super().build_group(weights, layout, capacity)  # torch computes in its own dtype: no scale
        folder, group = self._find(GroupSpec(weights, layout, capacity, scale))
        return CoreMLGroupGraph(lambda: self._load(compiled_package(folder, group.package), group.function),
                                len(group.experts), group.scale)

    @torch.inference_mode()
    def time_groups(self, groups: Mapping[str, GroupSpec]) -> dict[str, GroupMeasure]:
        """Each group's compiled function timed on the configured compute units, and the share of its ops
        Core ML's compute plan places on the Neural Engine. The compute plan is read first: a function placed
        mostly off the Neural Engine stays on the CPU whatever its time, so it is not loaded to be timed. (A function
        that is, is loaded twice: Core ML loads a compute plan from the compiled package on its own,
        `MLComputePlan.load_from_path`, and takes no loaded model.)"""
        if not self.available:
            return {}
        placed: dict[Path, dict[str, tuple[int, int]]] = {}  # compiled package -> function -> (on NE, all)
        measured = {}
        for key, spec in groups.items():
            folder, group = self._find(spec)
            package = compiled_package(folder, group.package)
            if package not in placed:
                placed[package] = neural_engine_ops(package, self.compute_units)
            on_engine, ops = placed[package].get(group.function, (0, 0))
            measure = GroupMeasure(seconds=None, device_ops=on_engine, ops=ops)
            if not measure.mostly_off:
                graph = self.build_group(spec.weights, spec.layout, spec.capacity, spec.scale)
                example = torch.zeros(len(group.experts), spec.capacity, spec.weights.hidden)
                measure = replace(measure, seconds=median_seconds(lambda graph=graph, example=example: graph(example)))
            measured[key] = measure
        return measured

    def _find(self, spec: GroupSpec) -> tuple[Path, CompiledGroup]:
        """The build folder and function compiled for this group."""
        found = self._builds().get((weights_fingerprint(spec.weights.gate_up, spec.weights.down), spec.capacity))
        if found is None:
            raise LookupError(f"no compiled {self.weights_format} Core ML graph for a group of {len(spec.weights)} "
                              f"experts at capacity {spec.capacity} under {self.cache_root}: run `npumoed prepare` "
                              f"or `npumoed compile --weights {self.weights_format}`")
        if found[1].scale != spec.scale:
            raise LookupError(f"the Core ML graph {found[1].function} was compiled at fp16 scale {found[1].scale}, "
                              f"the plan now needs {spec.scale}: compile again")
        return found

    def submit(self, calls: GraphCalls) -> Future[list[torch.Tensor]]:
        """Run a layer's hot group graphs, in order, on the backend's worker thread, so the caller can run
        the cold experts on the CPU meanwhile. Core ML's Python predict holds the GIL while the Neural
        Engine works (coremltools' `Model::predict` in coremlpython/CoreMLPython.mm never releases it: see
        docs/design.md), so the two overlap only inside torch kernels (which release it). Without Core ML the
        graphs run in torch at once: on the CPU they would only compete with the cold experts for cores."""
        if not self.available:
            return super().submit(calls)
        return self._worker.submit(lambda: [graph(x) for graph, x in calls])

    @torch.inference_mode()
    def measure_costs(self, hidden: int, ffn: int, dtype: torch.dtype, group_size: int) -> CostModel:
        """The CPU path's costs as torch-static measures them; launch cost and throughput from Core ML
        graphs of random experts at this geometry, converted and timed here."""
        costs = super().measure_costs(hidden, ffn, dtype, group_size)
        if not self.available:
            self._warn_fallback()
            return costs
        generator = torch.Generator().manual_seed(0)
        gate_up = torch.randn(group_size, 2 * ffn, hidden, generator=generator) / hidden**0.5
        down = torch.randn(group_size, hidden, ffn, generator=generator) / ffn**0.5
        with tempfile.TemporaryDirectory() as scratch:
            graphs = {}
            for capacity in _FIT_CAPACITIES:
                path = Path(scratch) / f"sample-c{capacity}.mlpackage"
                convert_group(ExpertWeights(gate_up, down), DEFAULT_LAYOUT, capacity,
                              weights_format=self.weights_format).save(str(path))
                graphs[capacity] = CoreMLGroupGraph(lambda path=path: self._load(path, None), group_size)
            launch_s, flops = fit_call_cost(
                lambda rows: graphs[rows](torch.zeros(group_size, rows, hidden)), *_FIT_CAPACITIES,
                flops=lambda rows: expert_flops(group_size * rows, hidden, ffn))
        return replace(costs, launch_s=launch_s, static_flops=flops)

    def _load(self, path: Path, function: str | None) -> Any:
        ct = import_coremltools()
        units = getattr(ct.ComputeUnit, self.compute_units.upper())  # the vocabulary spells them in lower case
        if path.suffix == ".mlmodelc":
            return ct.models.CompiledMLModel(str(path), units, function_name=function)
        return ct.models.MLModel(str(path), compute_units=units, function_name=function)

    def _builds(self) -> dict[tuple[str, int], tuple[Path, CompiledGroup]]:
        if self._index is None:
            self._index = compiled_groups(self.cache_root, coremltools_version(), self.weights_format)
        return self._index

    def _warn_fallback(self) -> None:
        if not self._warned:
            log.warning("coreml backend: %s; running its group graphs with torch-static instead", self.reason)
            self._warned = True


def compiled_package(folder: Path, package: str) -> Path:
    """The package compiled for this macOS (Core ML's .mlmodelc), compiled on first use and kept in the build;
    under the target's lock, so two processes never compile it over each other."""
    target = folder / f"{Path(package).stem}.macos-{platform.mac_ver()[0]}.mlmodelc"
    with folder_lock(target):
        if not target.exists():
            partial = target.with_name(f".partial-{os.getpid()}-{target.name}")  # compile_model wants .mlmodelc
            shutil.rmtree(partial, ignore_errors=True)
            import_coremltools().utils.compile_model(str(folder / package), str(partial))
            partial.rename(target)
    return target
