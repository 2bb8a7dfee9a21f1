"""The implementations the benchmarks compare, and how each is selected, planned and checked.

Every implementation runs behind the same call, a transformers experts module's forward, with the
implementation chosen through transformers' experts interface: `transformers-<name>` selects one of
transformers' own, `npumoe-<backend>[-prune]` attaches the engine, `npumoe-cpu-int8` and `npumoe-cpu-int4` the
engine with its experts quantized. The engine's static paths run a plan calibrated on loads the benchmark
measured itself, so a plan never sees the timed input.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
from transformers import PreTrainedModel

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
# int8 kernels, the activations) costs on random Gaussian weights (2 % and 14-16 % measured), with room.
QUANTIZED_TOLERANCE = {"int8": 0.03, "int4": 0.2}

TRANSFORMERS_IMPLS = ("eager", "grouped_mm")


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


def measure_impls(model: PreTrainedModel, plans: dict[str, PricedPlan], run: Callable[[], torch.Tensor], *,
                  tokens: int, warmup: int, repeats: int,
                  alongside: Mapping[str, Callable[[], object]] | None = None,
                  weights: Sequence[str] = ()) -> list[dict]:
    """Every implementation, and the engine with its experts quantized to each of `weights`, on `run()`: checked
    against transformers-eager, then timed side by side in rounds that run each once (median seconds, and each
    round's in `round_seconds`), so that the machine's drift moves all of them alike.

    An implementation that raises is reported (transformers': skipped, cannot run here; the engine's:
    refused) instead of stopping the benchmark; so is an engine path whose output misses (an exact one's
    tolerance, a quantized one's error bound), which is never timed. The engine's runtimes share one packed
    copy of the weights. `alongside`: more calls to time in the same rounds (a roofline's), each reported as a
    row {"impl": name, "status", "seconds"}.
    """
    model.set_experts_implementation("eager")
    reference = run()
    rows: dict[str, dict] = {}
    timed: dict[str, Callable[[], object]] = {}  # holds the runtimes of the paths it times
    for impl in (*IMPLS, *(EnginePath(CPU, SPILL, format).impl for format in weights)):
        try:
            runtime = build_runtime(model, impl, plans)
            with selected(model, impl, runtime):
                rows[impl] = gate(impl, run(), reference, reference.dtype)
            if runtime is not None:
                rows[impl].update(dispatch_fractions(runtime.stats))  # of the checked run
            if rows[impl]["status"] != "refused":
                timed[impl] = partial(_run_selected, model, impl, runtime, run)
        except Exception as e:  # a benchmark reports a broken implementation; it does not stop on it
            rows[impl] = _broken(impl, e)
    extra = dict(alongside or {})
    rounds = interleaved_seconds({**timed, **extra}, warmup=warmup, repeats=repeats)
    for name, times in rounds.items():
        if name in extra:
            rows[name] = ({"impl": name, "status": "skipped", "error": f"{type(times).__name__}: {times}"}
                          if isinstance(times, Exception)
                          else {"impl": name, "status": "ok", "seconds": statistics.median(times)})
        elif isinstance(times, Exception):
            rows[name] = _broken(name, times)
        else:
            seconds = statistics.median(times)
            rows[name].update(seconds=seconds, tokens_per_s=tokens / seconds, round_seconds=times)
    model.set_experts_implementation("eager")
    return list(rows.values())


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


def gate(impl: str, output: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> dict:
    """The correctness check before timing: relative error, and a refusal when an exact path misses."""
    error = relative_error(output, reference)
    path = ENGINE_PATHS.get(impl)
    tolerance = QUANTIZED_TOLERANCE[path.weights] if path is not None and path.weights else TOLERANCE[dtype]
    row: dict = {"impl": impl, "rel_error": error, "tolerance": tolerance}
    if path is not None and path.overflow != SPILL:  # pruning drops assignments: no bound holds
        return {**row, "status": "approximate"}
    if not error <= tolerance:  # also refuses NaN
        return {**row, "status": "refused", "error": f"output differs from {REFERENCE}: relative error "
                                                    f"{error:.2e} > tolerance {tolerance:.0e}"}
    return {**row, "status": "ok" if path is None or path.exact else "approximate"}


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


def add_ratios(rows: list[dict], baseline: str | None = None) -> list[dict]:
    """Each timed row's speed relative to transformers' best implementation (and to `baseline`'s row)."""
    timed = [r for r in rows if "tokens_per_s" in r]
    best = max((r["tokens_per_s"] for r in timed if r["impl"].startswith("transformers-")), default=None)
    base = next((r["tokens_per_s"] for r in timed if r["impl"] == baseline), None)
    for r in timed:
        if best:
            r["vs_transformers_best"] = r["tokens_per_s"] / best
        if base:
            r[f"vs_{baseline}"] = r["tokens_per_s"] / base
    return rows


def round_ratios(row: dict, against: dict) -> list[float]:
    """`row`'s speed as a multiple of `against`'s in each round they were timed in together (measure_impls)."""
    return [theirs / ours for ours, theirs in zip(row["round_seconds"], against["round_seconds"], strict=True)]


def best_engine_row(rows: Sequence[dict]) -> dict | None:
    """The fastest of the engine's exact paths that passed the check (the one a speed target is about)."""
    passed = [r for r in rows if r["impl"] in ENGINE_PATHS and ENGINE_PATHS[r["impl"]].exact and r["status"] == "ok"]
    return max(passed, key=lambda r: r["tokens_per_s"], default=None)
