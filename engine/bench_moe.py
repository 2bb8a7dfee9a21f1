"""MoE-layer prefill throughput: transformers' experts implementations against the engine's, side by side.

For each geometry and dtype one layer is built from the family's real transformers experts class on
random weights; for each chunk length every implementation runs on the same input and the same skewed
routing, through the same call (`experts(hidden, top_k_index, top_k_weights)`), with the implementation
selected through transformers' experts interface. The engine's plan is calibrated on other draws of the
same routing distribution, as a deployed plan would be on other text.

Before anything is timed, each implementation's output is checked against transformers-eager; a path
that fails the check is refused and not timed. Paths that prune are approximate by design: they are
timed, marked, and reported with their error and dropped fraction, but never count as the engine's best.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from .backends import get_backend
from .calibrate import Calibration, _statistics
from .dispatch import DispatchStats
from .models import moe_experts
from .moe_geometry import Geometry, build_layer_model, draw_routing, layer_experts, routing_prior
from .plan import ExpertPlan
from .planner import DEFAULT_GROUP_SIZE, make_plan
from .roofline import moe_roofline
from .runtime import MoeRuntime
from .timing import median_seconds

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# Largest relative L2 error against transformers-eager that still counts as the same output: fp32
# differs only in summation order; bf16 rounds every intermediate (eager even accumulates in bf16).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}

TRANSFORMERS_IMPLS = ("eager", "grouped_mm")


@dataclass(frozen=True)
class EnginePath:
    backend: str
    overflow: str

    @property
    def exact(self) -> bool:
        return self.overflow == "spill"


ENGINE_PATHS = {
    "npumoe-cpu": EnginePath("cpu", "spill"),
    "npumoe-torch-static": EnginePath("torch-static", "spill"),
    "npumoe-torch-static-prune": EnginePath("torch-static", "prune"),
}

IMPLS = (*(f"transformers-{name}" for name in TRANSFORMERS_IMPLS), *ENGINE_PATHS)


@dataclass(frozen=True)
class BenchSettings:
    threads: int
    warmup: int = 2
    repeats: int = 5
    seed: int = 0
    skew: float = 1.0  # Zipf exponent of expert popularity
    calibration_chunks: int = 8  # routing draws the plan is calibrated on

    def __post_init__(self) -> None:
        if self.threads < 1 or self.warmup < 0 or self.repeats < 1 or self.calibration_chunks < 1:
            raise ValueError(f"need threads, repeats and calibration chunks >= 1 and warmup >= 0, got {self}")


def run_moe_bench(geometries: Sequence[Geometry], tokens: Sequence[int], dtypes: Sequence[str],
                  settings: BenchSettings, *, bandwidth: float,
                  on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """One result row per (geometry, dtype, tokens, implementation), plus one `roofline` row per case.

    `bandwidth` (bytes/s) prices the roofline's weight reads; `on_result` sees each row as it lands.
    """
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown or any(t < 1 for t in tokens):
        raise ValueError(f"dtypes must be among {', '.join(DTYPES)} and token counts positive, "
                         f"got dtypes {list(dtypes)}, tokens {list(tokens)}")
    results: list[dict] = []

    def report(row: dict) -> None:
        results.append(row)
        if on_result is not None:
            on_result(row)

    with torch.inference_mode():
        for geometry in geometries:
            for dtype_name in dtypes:
                generator = torch.Generator().manual_seed(settings.seed)
                model = build_layer_model(geometry, DTYPES[dtype_name], generator)
                prior = routing_prior(geometry, generator, skew=settings.skew)
                for n_tokens in tokens:
                    case = {"geometry": geometry.name, "tokens": n_tokens, "dtype": dtype_name,
                            "threads": settings.threads}
                    for row in _bench_case(model, geometry, prior, n_tokens, DTYPES[dtype_name], settings,
                                           generator, bandwidth):
                        report({**case, **row})
                del model
                gc.collect()
    return results


def _bench_case(model: PreTrainedModel, geometry: Geometry, prior: torch.Tensor, tokens: int,
                dtype: torch.dtype, settings: BenchSettings, generator: torch.Generator,
                bandwidth: float) -> Iterator[dict]:
    """Rows for one chunk length: every implementation, then the roofline, with ratios filled in."""
    experts = layer_experts(model)
    plans = _plans(model, geometry, prior, tokens, dtype, settings, generator)
    x = torch.randn(tokens, geometry.hidden, generator=generator).to(dtype)
    index, weights = draw_routing(prior, tokens, geometry.top_k, generator)
    weights = weights.to(dtype)  # transformers' routers hand the experts weights in the model dtype

    def call() -> torch.Tensor:
        return experts(x, index, weights)

    model.set_experts_implementation("eager")
    reference = call()
    rows = []
    for impl in IMPLS:
        path = ENGINE_PATHS.get(impl)
        try:
            with _selected(model, impl, plans) as runtime:
                rows.append(_measure(impl, call, reference, dtype, settings, runtime, path))
        except Exception as e:  # an implementation that cannot run here is reported, not fatal
            status = "refused" if path else "skipped"
            rows.append({"impl": impl, "status": status, "error": f"{type(e).__name__}: {e}"})

    roofline = moe_roofline(tokens=tokens, top_k=geometry.top_k, hidden=geometry.hidden, ffn=geometry.ffn,
                            experts_touched=int(index.unique().numel()), dtype=dtype, bandwidth=bandwidth,
                            warmup=settings.warmup, repeats=settings.repeats)
    rows.append({"impl": "roofline", "status": "ok", "seconds": roofline.seconds,
                 "tokens_per_s": tokens / roofline.seconds, "bound": roofline.bound, "flops": roofline.flops,
                 "weight_bytes": roofline.weight_bytes, "compute_s": roofline.compute_s,
                 "memory_s": roofline.memory_s})
    yield from _with_ratios(rows)


def _measure(impl: str, call: Callable[[], torch.Tensor], reference: torch.Tensor, dtype: torch.dtype,
             settings: BenchSettings, runtime: MoeRuntime | None, path: EnginePath | None) -> dict:
    """Check the output against the reference, then time it (unless refused)."""
    error = relative_error(call(), reference)
    approximate = path is not None and not path.exact
    row: dict = {"impl": impl, "rel_error": error, "tolerance": TOLERANCE[dtype]}
    if error > TOLERANCE[dtype] and not approximate:
        return {**row, "status": "refused",
                "error": f"output differs from transformers-eager: relative error {error:.2e} "
                         f"> tolerance {TOLERANCE[dtype]:.0e}"}
    if runtime is not None:
        runtime.stats = DispatchStats()
        call()
        row.update(_dispatch_fractions(runtime.stats))
    seconds = median_seconds(call, warmup=settings.warmup, repeats=settings.repeats)
    return {**row, "status": "approximate" if approximate else "ok", "seconds": seconds,
            "tokens_per_s": reference.shape[0] / seconds}


def _dispatch_fractions(stats: DispatchStats) -> dict:
    counts = stats.to_dict()
    assignments = max(stats.assignments, 1)
    return {"padding_fraction": counts["padding_fraction"], "dropped_fraction": counts["dropped_fraction"],
            "spilled_fraction": stats.spilled / assignments, "static_fraction": stats.static / assignments,
            "launches": stats.launches}


def _with_ratios(rows: list[dict]) -> list[dict]:
    """Add each timed row's speed relative to transformers' best implementation and to the roofline."""
    timed = [r for r in rows if "tokens_per_s" in r]
    transformers_best = max((r["tokens_per_s"] for r in timed if r["impl"].startswith("transformers-")),
                            default=None)
    roofline = next(r["tokens_per_s"] for r in rows if r["impl"] == "roofline")
    for r in timed:
        if transformers_best:
            r["vs_transformers_best"] = r["tokens_per_s"] / transformers_best
        r["vs_roofline"] = r["tokens_per_s"] / roofline
    return rows


def relative_error(output: torch.Tensor, reference: torch.Tensor) -> float:
    """‖output − reference‖ / ‖reference‖, in float64."""
    if output.shape != reference.shape:
        raise ValueError(f"output shape {tuple(output.shape)} differs from the reference {tuple(reference.shape)}")
    reference = reference.double()
    return float((output.double() - reference).norm() / reference.norm().clamp_min(1e-30))


@contextmanager
def _selected(model: PreTrainedModel, impl: str, plans: dict[str, ExpertPlan]) -> Iterator[MoeRuntime | None]:
    """Select `impl` for the model's experts; for the engine's paths, yield the attached runtime."""
    if impl.startswith("transformers-"):
        model.set_experts_implementation(impl.removeprefix("transformers-"))
        yield None
        return
    path = ENGINE_PATHS[impl]
    backend = get_backend(path.backend)
    runtime = MoeRuntime(model, backend, plans[path.overflow] if backend.static else None, overflow=path.overflow)
    try:
        yield runtime
    finally:
        runtime.detach()


def _plans(model: PreTrainedModel, geometry: Geometry, prior: torch.Tensor, tokens: int, dtype: torch.dtype,
           settings: BenchSettings, generator: torch.Generator) -> dict[str, ExpertPlan]:
    """torch-static plans (one per overflow policy) calibrated on fresh routing draws of `tokens` each."""
    draws = [draw_routing(prior, tokens, geometry.top_k, generator)[0] for _ in range(settings.calibration_chunks)]
    loads = torch.stack([torch.bincount(index.reshape(-1), minlength=geometry.experts) for index in draws])
    name, _ = moe_experts(model)[0]
    calibration = Calibration(chunk_tokens=tokens, tokens=tokens * len(draws), chunks=len(draws),
                              sources=(f"zipf-routing(skew={settings.skew}, seed={settings.seed})",),
                              layers=((name, _statistics(loads.float())),))
    backend = get_backend("torch-static")
    cost = backend.measure_costs(geometry.hidden, geometry.ffn, dtype, group_size=DEFAULT_GROUP_SIZE)
    return {overflow: make_plan(calibration, model=geometry.name, model_key=geometry.name, backend=backend.name,
                                cost=cost, hidden=geometry.hidden, ffn=geometry.ffn, overflow=overflow)
            for overflow in ("spill", "prune")}

