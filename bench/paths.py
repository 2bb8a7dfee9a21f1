"""The implementations the benchmarks compare, and how each is selected, planned and checked.

Every implementation runs behind the same call, a transformers experts module's forward, with the
implementation chosen through transformers' experts interface: `transformers-<name>` selects one of
transformers' own, `npumoe-<backend>[-prune]` attaches the engine, `npumoe-cpu-int8` and `npumoe-cpu-int4` the
engine with its experts quantized. The engine's static paths run a plan calibrated on loads the benchmark
measured itself, so a plan never sees the timed input.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
from transformers import PreTrainedModel

from npumoe.engine.attach.projections import ProjectionLinear
from npumoe.engine.attach.runtime import MoeRuntime
from npumoe.engine.backends.registry import get_backend
from npumoe.engine.calibration.calibrate import Calibration, load_statistics
from npumoe.engine.calibration.planner import DEFAULT_GROUP_SIZE, make_plan
from npumoe.engine.moe.dispatch import DispatchStats
from npumoe.engine.plan.cost_cache import machine
from npumoe.engine.plan.expert_plan import ExpertPlan
from npumoe.engine.plan.residency import MeasuredCosts, Residency, decide_residency
from npumoe.engine.vocabulary import CPU, PRUNE, QUANTIZED, SPILL, TORCH_STATIC

from .timing import interleaved_seconds

PricedPlan = tuple[ExpertPlan, Residency]  # a plan and where its groups run on the backend, from costs measured here

# Largest relative L2 error against transformers-eager that still counts as the same output: fp32
# differs only in summation order; bf16 rounds every intermediate (eager even accumulates in bf16).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}

# Largest relative L2 error a quantized path may have and still be timed: what rounding the weights (and, in the
# int8 kernels, the activations) costs on random Gaussian weights, with room. Prefill's int8 path rounds attention's
# projections as well as the experts, and each layer is checked on its own: 3.1 % measured after the first layer of
# qwen3-30b-a3b (experts alone 2.65 %, bench/results/fidelity-weights-*); int4's experts 14-16 %.
QUANTIZED_TOLERANCE = {"int8": 0.04, "int4": 0.2}

# A bf16 exact path may be this many times as far from the fp32 model as transformers-eager is (eager even
# accumulates in bf16), but is never held closer than one bf16 rounding. No fixed ceiling: eager's own error grows
# with the context (3.5 % after the first layer at 16,384 tokens, where a 2 % ceiling refused eager itself).
OWN_FACTOR = 2.0
ROUNDING = {torch.bfloat16: 2**-8}

TRANSFORMERS_IMPLS = ("eager", "grouped_mm")
Output = torch.Tensor | Sequence[torch.Tensor]  # what a benchmark's run returns: one tensor or one per layer


@dataclass(frozen=True)
class EnginePath:
    backend: str
    overflow: str
    weights: str | None = None  # the experts' quantized format; None: the model's float dtype

    @property
    def exact(self) -> bool:
        """Spill keeps every assignment; prune drops some by design and quantized weights round, so their
        outputs are approximate."""
        return self.overflow == SPILL and self.weights is None

    @property
    def impl(self) -> str:
        """Its name among the implementations: `npumoe-<backend>`, with `-prune` when it prunes and `-<format>`
        when its experts are quantized."""
        return "-".join(part for part in ("npumoe", self.backend, None if self.overflow == SPILL else self.overflow,
                                          self.weights) if part)


QUANTIZED_PATHS = {path.impl: path for path in (EnginePath(CPU, SPILL, weights) for weights in QUANTIZED)}
ENGINE_PATHS = {**{path.impl: path for path in (EnginePath(CPU, SPILL), EnginePath(TORCH_STATIC, SPILL),
                                                EnginePath(TORCH_STATIC, PRUNE))}, **QUANTIZED_PATHS}

CPU_PATH = EnginePath(CPU, SPILL).impl  # the daemon's default on a CPU
TORCH_STATIC_PATH = EnginePath(TORCH_STATIC, SPILL).impl
IMPLS = (*(f"transformers-{name}" for name in TRANSFORMERS_IMPLS),
         *(impl for impl in ENGINE_PATHS if impl not in QUANTIZED_PATHS))  # the quantized ones when asked for
REFERENCE = "transformers-eager"


def build_runtime(model: PreTrainedModel, impl: str, plans: dict[str, PricedPlan]) -> MoeRuntime | None:
    """The engine's runtime for `impl`, built and left detached; None for transformers' own implementations."""
    if impl.startswith("transformers-"):
        return None
    if impl not in ENGINE_PATHS:
        raise ValueError(f"unknown implementation {impl!r}; choose one of {', '.join(IMPLS)}")
    path = ENGINE_PATHS[impl]
    backend = get_backend(path.backend)
    plan, residency = plans[path.overflow] if backend.static else (None, None)
    runtime = MoeRuntime(model, backend, plan, overflow=path.overflow, residency=residency, quantized=path.weights)
    runtime.detach()
    return runtime


@contextmanager
def selected(model: PreTrainedModel, impl: str, runtime: MoeRuntime | None) -> Iterator[None]:
    """Inside the block the model's experts run `impl`: transformers' by name, the engine's through `runtime`."""
    if runtime is None:
        model.set_experts_implementation(impl.removeprefix("transformers-"))
        yield
        return
    runtime.attach()
    try:
        yield
    finally:
        runtime.detach()


def measure_impls(model: PreTrainedModel, plans: dict[str, PricedPlan], run: Callable[[], Output], *,
                  tokens: int, warmup: int, repeats: int, min_seconds: float = 0.0,
                  first: Callable[[], object] | None = None, truth: Callable[[], Output] | None = None,
                  alongside: Mapping[str, Callable[[], object]] | None = None,
                  elsewhere: Mapping[str, tuple[Callable[[], object], Callable[[], Output]]] | None = None,
                  weights: Sequence[str] = ()) -> list[dict]:
    """Every implementation, and the engine with its experts quantized to each of `weights`, on `run()`: checked
    against transformers-eager, then timed side by side in rounds that run each once (median seconds, and each
    round's in `round_seconds`; at least `repeats` rounds, more until they add up to `min_seconds`), so that the
    machine's drift moves all of them alike; then the output of each one's last timed round is checked again
    (`rel_error_after`): an engine path whose timed output missed is refused after all.

    `run()` returns one tensor or several (a prefill's hidden states after each layer): each is checked on its own,
    so that one layer's error is not diluted by the others'. `truth`: the same run in fp32, where the model's dtype
    rounds; an exact path's tolerance is derived from eager's own error from it (Reference). `first`: the call that
    makes the first chunk ready; each path's load time (its packing, quantizing and kernel choice, then `first`
    once) is measured from a runtime of its own before anything else (load_seconds).

    An implementation that raises is reported (transformers': skipped, cannot run here; the engine's:
    refused) instead of stopping the benchmark; so is an engine path whose output misses (an exact one's
    tolerance, a quantized one's error bound), which is never timed. The engine's runtimes share one packed
    copy of the weights. `alongside`: more calls to time in the same rounds (a roofline's), each reported as a
    row {"impl": name, "status", "seconds", "round_seconds"}. `elsewhere`: implementations that run outside this
    process (transformers in a process of its own), each as (call, a call giving its output): checked like the
    others, then timed in the same rounds.
    """
    impls = (*IMPLS, *(EnginePath(CPU, SPILL, format).impl for format in weights))
    model.set_experts_implementation("eager")
    reference = Reference.of(run(), truth() if truth is not None else None)
    loads = {impl: load_seconds(model, impl, plans, first) for impl in impls} if first is not None else {}
    rows: dict[str, dict] = {}
    timed: dict[str, Callable[[], object]] = {}  # holds the runtimes of the paths it times
    last: dict[str, Output] = {}  # each timed path's output in its latest round
    for impl in impls:
        try:
            runtime = build_runtime(model, impl, plans)
            with selected(model, impl, runtime):
                rows[impl] = gate(impl, run(), reference)
            if runtime is not None:
                rows[impl].update(dispatch_fractions(runtime.stats))  # of the checked run
                rows[impl].update(quantized_parts(model, runtime, impl))
            if rows[impl]["status"] != "refused":
                timed[impl] = partial(_kept, last, impl, partial(_run_selected, model, impl, runtime, run))
        except Exception as e:  # a benchmark reports a broken implementation; it does not stop on it
            rows[impl] = _broken(impl, e)
        if impl in loads and impl in rows:
            rows[impl].update(loads[impl])
    for name, (call, output) in (elsewhere or {}).items():
        try:
            rows[name] = gate(name, output(), reference)
        except Exception as e:  # reported, as for transformers' own implementations
            rows[name] = _broken(name, e)
        if rows[name]["status"] == "ok":
            timed[name] = call
    extra = dict(alongside or {})
    rounds = interleaved_seconds({**timed, **extra}, warmup=warmup, repeats=repeats, min_seconds=min_seconds)
    for name, times in rounds.items():
        if isinstance(times, Exception):
            rows[name] = ({"impl": name, "status": "skipped", "error": f"{type(times).__name__}: {times}"}
                          if name in extra else _broken(name, times))
            continue
        seconds = statistics.median(times)
        rows[name] = {**rows.get(name, {"impl": name, "status": "ok"}), "seconds": seconds,
                      "tokens_per_s": tokens / seconds, "round_seconds": times}
        if name in last:
            _check_after_timing(rows[name], last.pop(name), reference)
    model.set_experts_implementation("eager")
    return list(rows.values())


def _kept(last: dict[str, Output], name: str, fn: Callable[[], Output]) -> None:
    last[name] = fn()


def _check_after_timing(row: dict, output: Output, reference: Reference) -> None:
    """The last timed round's output against the reference, as before timing: a path that drifted is refused."""
    after = gate(row["impl"], output, reference)
    row["rel_error_after"] = after["rel_error"]
    if after["status"] == "refused" and row["status"] != "refused":
        row.update(status="refused", error=f"after the timed rounds: {after['error']}")


def load_seconds(model: PreTrainedModel, impl: str, plans: dict[str, PricedPlan],
                 first: Callable[[], object]) -> dict:
    """What a person waits for before `impl`'s first chunk, from the model's float weights in memory: the
    engine's runtime built from nothing (packing, quantizing, static graphs, the projections' kernel choice as this
    process's kernel cache holds it) in `prepare_s`, then `first()` once in `first_chunk_s`; `load_s` both. The
    runtime is dropped after, so the next path's is built from nothing too (runtimes share a packed copy)."""
    start = time.perf_counter()
    try:
        runtime = build_runtime(model, impl, plans)
        prepared = time.perf_counter()
        with selected(model, impl, runtime):
            first()
    except Exception:  # measure_impls reports why it broke when it builds the path again
        return {}
    done = time.perf_counter()
    del runtime
    gc.collect()
    return {"prepare_s": prepared - start, "first_chunk_s": done - prepared, "load_s": done - start}


def quantized_parts(model: PreTrainedModel, runtime: MoeRuntime, impl: str) -> dict:
    """What ran quantized on a quantized path, read from the attached runtime: the experts, and how many of the
    model's dense projections measured faster quantized (projections.py) and took their format."""
    path = ENGINE_PATHS[impl]
    if path.weights is None:
        return {}
    with selected(model, impl, runtime):
        formats = [module.format for module in model.modules() if isinstance(module, ProjectionLinear)]
    projections = [format for format in formats if format is not None]
    return {"quantized": f"{path.weights} experts" + (f" + {projections[0]} projections ({len(projections)} of "
                                                     f"{len(formats)})" if projections else "")}


def _run_selected(model: PreTrainedModel, impl: str, runtime: MoeRuntime | None,
                  run: Callable[[], torch.Tensor]) -> torch.Tensor:
    with selected(model, impl, runtime):
        return run()


def _broken(impl: str, error: Exception) -> dict:
    return {"impl": impl, "status": "refused" if impl in ENGINE_PATHS else "skipped",
            "error": f"{type(error).__name__}: {error}"}


def calibration_from_loads(layers: Sequence[tuple[str, torch.Tensor]], *, chunk_tokens: int,
                           source: str) -> Calibration:
    """A calibration from each layer's (chunks, E) routed-token counts, measured by the benchmark."""
    chunks = {counts.shape[0] for _, counts in layers}
    if len(chunks) != 1 or 0 in chunks:
        raise ValueError(f"every layer needs the same, non-zero number of counted chunks, got {sorted(chunks)}")
    n_chunks = chunks.pop()
    return Calibration(chunk_tokens=chunk_tokens, tokens=chunk_tokens * n_chunks, chunks=n_chunks,
                       sources=(source,),
                       layers=tuple((name, load_statistics(counts.float())) for name, counts in layers))


def static_plans(calibration: Calibration, *, model: str, hidden: int, ffn: int,
                 dtype: torch.dtype) -> dict[str, PricedPlan]:
    """torch-static plans for `calibration`, one per overflow policy, each with its residency from costs
    measured here."""
    backend = get_backend(TORCH_STATIC)
    costs = MeasuredCosts(backend.measure_costs(hidden, ffn, dtype, group_size=DEFAULT_GROUP_SIZE), hidden, ffn,
                          measured_on=f"{backend.name} on {machine()}")
    plans = {path.overflow: make_plan(calibration, model=model, model_key=model)
             for path in ENGINE_PATHS.values() if path.backend == backend.name}
    return {overflow: (plan, decide_residency(plan, backend, costs)) for overflow, plan in plans.items()}


@dataclass(frozen=True)
class Reference:
    """What outputs are checked against, part by part: transformers-eager's, and where the model's dtype rounds
    (bf16), the same model's in fp32 (`truth`) with eager's own error from it (`own`): an exact path then passes
    where its error from the truth is at most OWN_FACTOR times eager's. Without a truth (an fp32 model, which
    differs only in summation order) it is checked against eager within the dtype's fixed TOLERANCE."""

    eager: tuple[torch.Tensor, ...]
    truth: tuple[torch.Tensor, ...] | None = None
    own: tuple[float, ...] | None = None

    @classmethod
    def of(cls, eager: Output, truth: Output | None = None) -> Reference:
        eager = parts(eager)
        if truth is None:
            return cls(eager)
        truth = parts(truth)
        return cls(eager, truth, tuple(relative_error(e, t) for e, t in zip(eager, truth, strict=True)))

    @property
    def dtype(self) -> torch.dtype:
        return self.eager[0].dtype

    def tolerances(self) -> tuple[list[float], str]:
        """An exact path's tolerance for each part, and where it comes from."""
        fixed = TOLERANCE[self.dtype]
        if self.own is None or not any(self.own):
            return [fixed] * len(self.eager), "fixed"
        return ([max(ROUNDING[self.dtype], OWN_FACTOR * e) for e in self.own],
                f"{OWN_FACTOR:g} × eager's error from fp32")

    def quantized_tolerances(self, format: str) -> tuple[list[float], str]:
        """A quantized path's tolerance from eager for each part: its format's bound, plus what an exact path may be
        off (OWN_FACTOR × eager's error from the fp32 model, where there is one): a quantized path's error from eager
        holds its float arithmetic's as well as its rounding."""
        bound = QUANTIZED_TOLERANCE[format]
        if self.own is None:
            return [bound] * len(self.eager), "format's bound"
        return ([bound + OWN_FACTOR * e for e in self.own],
                f"format's bound + {OWN_FACTOR:g} × eager's error from fp32")


def gate(impl: str, output: Output, reference: Reference | Output) -> dict:
    """The correctness check: the relative error from transformers-eager (`rel_error`, the largest part's), each
    part's error from what an exact path is checked against (`part_errors`, see Reference), and a refusal when an
    exact path misses in any part or a quantized one goes beyond its format's bound."""
    if not isinstance(reference, Reference):
        reference = Reference.of(reference)
    output = parts(output)
    if len(output) != len(reference.eager):
        raise ValueError(f"output has {len(output)} parts, the reference {len(reference.eager)}")
    from_eager = [relative_error(o, r) for o, r in zip(output, reference.eager, strict=True)]
    path = ENGINE_PATHS.get(impl)
    if path is not None and path.weights:
        errors = from_eager
        tolerances, source = reference.quantized_tolerances(path.weights)
    else:
        tolerances, source = reference.tolerances()
        errors = (from_eager if reference.truth is None or source == "fixed" else
                  [relative_error(o, t) for o, t in zip(output, reference.truth, strict=True)])
    worst = max(range(len(errors)), key=lambda i: errors[i] / tolerances[i] if errors[i] == errors[i] else math.inf)
    row: dict = {"impl": impl, "rel_error": max(from_eager), "part_errors": errors, "tolerance": tolerances[worst],
                 "tolerance_from": source}
    if path is not None and path.overflow != SPILL:  # pruning drops assignments: no bound holds
        return {**row, "status": "approximate"}
    if not errors[worst] <= tolerances[worst]:  # also refuses NaN
        against = REFERENCE if reference.truth is None or source == "fixed" else "the fp32 model"
        where = f" in part {worst + 1} of {len(errors)}" if len(errors) > 1 else ""
        return {**row, "status": "refused", "error": f"output differs from {against}{where}: relative error "
                                                    f"{errors[worst]:.2e} > tolerance {tolerances[worst]:.1e} "
                                                    f"({source})"}
    return {**row, "status": "ok" if path is None or path.exact else "approximate"}


def parts(output: Output) -> tuple[torch.Tensor, ...]:
    """A run's output as the tuple of tensors it is checked by."""
    return (output,) if isinstance(output, torch.Tensor) else tuple(output)


def relative_error(output: torch.Tensor, reference: torch.Tensor) -> float:
    """‖output − reference‖ / ‖reference‖, in float64."""
    if output.shape != reference.shape:
        raise ValueError(f"output shape {tuple(output.shape)} differs from the reference {tuple(reference.shape)}")
    reference = reference.double()
    return float((output.double() - reference).norm() / reference.norm().clamp_min(1e-30))


def dispatch_fractions(stats: DispatchStats) -> dict:
    """What the engine did with the assignments: padded slots, spills, drops, graph launches."""
    counts = stats.to_dict()
    assignments = max(stats.assignments, 1)
    return {"padding_fraction": counts["padding_fraction"], "dropped_fraction": counts["dropped_fraction"],
            "spilled_fraction": stats.spilled / assignments, "static_fraction": stats.static / assignments,
            "launches": stats.launches}
