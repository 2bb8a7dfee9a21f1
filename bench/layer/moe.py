"""MoE-layer prefill throughput: transformers' experts implementations against the engine's, side by side.

For each geometry and dtype one layer is built from the family's real transformers experts class on
random weights; for each chunk length every implementation runs on the same input and the same skewed
routing, through the same call (`experts(hidden, top_k_index, top_k_weights)`). The engine's plan is
calibrated on other draws of the same routing distribution, as a deployed plan is on other text.

Before anything is timed, each implementation's output is checked against transformers-eager; an exact
path that fails the check is refused and not timed. Paths that prune are approximate by design: they
are timed and marked, with their error and dropped fraction. The engine's paths with quantized experts (`weights`)
are approximate too: they are timed when their error is within the format's bound. A roofline row closes each
case, and one per quantized format priced at that format's bytes (`roofline-<format>`), which the format's row
is measured against.
"""

from __future__ import annotations

import gc
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from transformers import PreTrainedModel

from npumoe.engine.loading.load import TORCH_DTYPES
from npumoe.engine.moe.model_experts import moe_experts
from npumoe.engine.synthetic.geometry import Geometry, build_layer_model, draw_routing, routing_prior
from npumoe.engine.vocabulary import CPU, QUANTIZED, SPILL

from ..fair.own_process import transformers_elsewhere
from ..fair.paired import add_ratios
from ..fair.workloads import in_float32
from ..paths import EnginePath, calibration_from_loads, measure_impls, static_plans
from .roofline import dense_matmuls, moe_roofline

ROOFLINE = "roofline"  # its row; a quantized path's own is "roofline-<format>", priced at the format's bytes
DENSE = "roofline-dense-"  # the names the roofline's matmuls are timed under


@dataclass(frozen=True)
class MoeBenchSettings:
    threads: int
    warmup: int = 2
    repeats: int = 5
    min_seconds: float = 0.0  # more rounds than `repeats` until the timed ones add up to this
    own_process: bool = False  # also transformers in a process of its own, under torch's OpenMP defaults
    seed: int = 0
    skew: float = 1.0  # Zipf exponent of expert popularity
    calibration_chunks: int = 8  # routing draws the plan is calibrated on
    weights: tuple[str, ...] = ()  # quantized formats the engine's CPU path also runs in (vocabulary.QUANTIZED)

    def __post_init__(self) -> None:
        if (self.threads < 1 or self.warmup < 0 or self.repeats < 1 or self.calibration_chunks < 1
                or self.min_seconds < 0):
            raise ValueError(f"need threads, repeats and calibration chunks >= 1 and warmup, min_seconds >= 0, "
                             f"got {self}")
        if not set(self.weights) <= set(QUANTIZED):
            raise ValueError(f"quantized weights must be among {', '.join(QUANTIZED)}, got {list(self.weights)}")


def run_moe_bench(geometries: Sequence[Geometry], tokens: Sequence[int], dtypes: Sequence[str],
                  settings: MoeBenchSettings, *, bandwidth: float,
                  on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """One row per (geometry, dtype, tokens, implementation), plus a `roofline` row per case.

    `bandwidth` (bytes/s) prices the roofline's weight reads; `on_result` sees each row as it lands.
    """
    unknown = [d for d in dtypes if d not in TORCH_DTYPES]
    if unknown or any(t < 1 for t in tokens):
        raise ValueError(f"dtypes must be among {', '.join(TORCH_DTYPES)} and token counts positive, "
                         f"got dtypes {list(dtypes)}, tokens {list(tokens)}")
    results: list[dict] = []
    with torch.inference_mode():
        for geometry in geometries:
            for dtype_name in dtypes:
                generator = torch.Generator().manual_seed(settings.seed)
                model = build_layer_model(geometry, TORCH_DTYPES[dtype_name], generator)
                prior = routing_prior(geometry, generator, skew=settings.skew)
                for n_tokens in tokens:
                    case = {"geometry": geometry.name, "tokens": n_tokens, "dtype": dtype_name,
                            "threads": settings.threads}
                    for row in _bench_case(model, geometry, dtype_name, prior, n_tokens, settings, generator,
                                           bandwidth):
                        results.append({**case, **row})
                        if on_result is not None:
                            on_result(results[-1])
                del model
                gc.collect()
    return results


def _bench_case(model: PreTrainedModel, geometry: Geometry, dtype_name: str, prior: torch.Tensor, tokens: int,
                settings: MoeBenchSettings, generator: torch.Generator, bandwidth: float) -> list[dict]:
    """Rows for one chunk length: every implementation, then the roofline, with ratios filled in."""
    name, experts = moe_experts(model)[0]
    dtype = experts.gate_up_proj.dtype
    draws = [draw_routing(prior, tokens, geometry.top_k, generator)[0] for _ in range(settings.calibration_chunks)]
    loads = torch.stack([torch.bincount(index.reshape(-1), minlength=geometry.experts) for index in draws])
    calibration = calibration_from_loads([(name, loads)], chunk_tokens=tokens,
                                         source=f"zipf-routing(skew={settings.skew}, seed={settings.seed})")
    plans = static_plans(calibration, model=geometry.name, hidden=geometry.hidden, ffn=geometry.ffn, dtype=dtype)

    x = torch.randn(tokens, geometry.hidden, generator=generator).to(dtype)
    index, weights = draw_routing(prior, tokens, geometry.top_k, generator)
    weights = weights.to(dtype)  # transformers' routers hand the experts their weights in the model dtype

    def call() -> torch.Tensor:
        return experts(x, index, weights)

    def call_fp32() -> torch.Tensor:
        return experts(x.float(), index, weights.float())

    # The roofline's dense matmuls run in the same rounds as the implementations, so drift moves all alike.
    dense = dense_matmuls(tokens=tokens, top_k=geometry.top_k, hidden=geometry.hidden, ffn=geometry.ffn,
                          dtype=dtype)
    with tempfile.TemporaryDirectory(prefix="npumoed-moe-") as folder:
        inputs = Path(folder) / "inputs.pt"
        torch.save((x, index, weights), inputs)
        spec = {"kind": "moe", "geometry": geometry.name, "dtype": dtype_name, "seed": settings.seed,
                "inputs": str(inputs), "threads": settings.threads}
        with transformers_elsewhere(spec, settings.own_process) as elsewhere:
            timed = measure_impls(model, plans, call, tokens=tokens, warmup=settings.warmup,
                                  repeats=settings.repeats, min_seconds=settings.min_seconds, first=call,
                                  truth=None if dtype == torch.float32 else partial(in_float32, model, call_fp32),
                                  alongside={DENSE + kernel: matmul for kernel, matmul in dense.items()},
                                  elsewhere=elsewhere, weights=settings.weights)
    rows = [row for row in timed if not row["impl"].startswith(DENSE)]
    dense_rows = {row["impl"].removeprefix(DENSE): row for row in timed
                  if row["impl"].startswith(DENSE) and row["status"] == "ok"}
    touched = int(index.unique().numel())
    rooflines = {ROOFLINE: None, **{f"{ROOFLINE}-{format}": format for format in settings.weights}}
    for name, format in rooflines.items():
        roofline = moe_roofline(tokens=tokens, top_k=geometry.top_k, hidden=geometry.hidden, ffn=geometry.ffn,
                                experts_touched=touched, dtype=dtype, bandwidth=bandwidth, weights_format=format,
                                compute_times={kernel: row["seconds"] for kernel, row in dense_rows.items()})
        compute_rounds = dense_rows[roofline.compute_kernel]["round_seconds"]
        rows.append({"impl": name, "status": "ok", "seconds": roofline.seconds,
                     "tokens_per_s": tokens / roofline.seconds, "bound": roofline.bound,
                     "compute_kernel": roofline.compute_kernel, "flops": roofline.flops,
                     "weight_bytes": roofline.weight_bytes, "compute_s": roofline.compute_s,
                     "memory_s": roofline.memory_s,
                     # each round's floor, from that round's dense matmul: the roofline's ratios pair too
                     "round_seconds": [max(seconds, roofline.memory_s) for seconds in compute_rounds]})
    priced = {EnginePath(CPU, SPILL, format).impl: name for name, format in rooflines.items() if format}
    return add_ratios(rows, baseline=ROOFLINE, priced=priced)
