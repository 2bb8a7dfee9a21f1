"""What capacity costs in accuracy: the engine's pruning and spilling against the exact model.

A model is calibrated on some texts; then, for each capacity scale s, the planner sizes the tiers for
s × each expert's calibrated 95th-percentile load, and held-out text is prefilled through the engine
with each overflow policy. Against the exact model's next-token distributions on the same text this
measures the top-1 agreement and the mean KL divergence, beside the dropped, spilled and padding
fractions and the prefill time: small capacities waste no padding but drop (or spill) more. Every group the
backend builds is placed (the accelerator policy): what the sweep measures is the tiers, whatever this machine's
costs would have kept on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from npumoe.engine.attach.runtime import MoeRuntime
from npumoe.engine.backends.registry import get_backend
from npumoe.engine.calibration.calibrate import Calibration, calibrate
from npumoe.engine.calibration.planner import DEFAULT_GROUP_SIZE, make_plan
from npumoe.engine.generate.prefill import new_cache, prefill, windows
from npumoe.engine.kernels.choice import median_seconds
from npumoe.engine.loading.load import LoadedModel
from npumoe.engine.moe.model_experts import moe_experts
from npumoe.engine.plan.cost_cache import machine
from npumoe.engine.plan.residency import MeasuredCosts, decide_residency
from npumoe.engine.vocabulary import ACCELERATOR, PRUNE, SPILL, TORCH_STATIC

from ..paths import dispatch_fractions

OVERFLOWS = (PRUNE, SPILL)  # the sweep's order: the policy that loses assignments, then the one that keeps them


@dataclass(frozen=True)
class FidelitySettings:
    threads: int
    scales: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0)
    chunk_tokens: int = 128
    eval_tokens: int = 4096  # at most this many held-out tokens
    warmup: int = 1
    repeats: int = 3

    def __post_init__(self) -> None:
        if not self.scales or min(self.scales) <= 0:
            raise ValueError(f"capacity scales must be positive, got {self.scales}")
        if min(self.threads, self.chunk_tokens, self.eval_tokens, self.repeats) < 1 or self.warmup < 0:
            raise ValueError(f"every size and count must be positive (warmup >= 0), got {self}")


def run_fidelity_bench(loaded: LoadedModel, calibration_texts: Sequence[tuple[str, str]], eval_text: str,
                       settings: FidelitySettings, *, on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """Rows: the exact model ("exact"), then one per (capacity scale, overflow policy) on the torch-static backend."""
    model, tokenizer = loaded.model, loaded.tokenizer
    ids = tokenizer(eval_text, add_special_tokens=False)["input_ids"][:settings.eval_tokens]
    if len(ids) < 2:
        raise ValueError("the held-out text needs at least two tokens")
    window = loaded.context_tokens // settings.chunk_tokens * settings.chunk_tokens
    if window == 0:
        raise ValueError(f"chunk length {settings.chunk_tokens} exceeds the model's context ({loaded.context_tokens})")

    def logits() -> torch.Tensor:  # (T, V): each window of the held-out text prefilled from an empty cache
        return torch.cat([chunk for piece in windows(ids, window)
                          for chunk in prefill(model, piece, settings.chunk_tokens, new_cache(model), logits=True)])

    def timed(row: dict) -> dict:
        seconds = median_seconds(logits, warmup=settings.warmup, repeats=settings.repeats)
        return {**row, "eval_tokens": len(ids), "seconds": seconds, "tokens_per_s": len(ids) / seconds}

    results: list[dict] = []

    def report(row: dict) -> None:
        results.append({"chunk_tokens": settings.chunk_tokens, "threads": settings.threads, **row})
        if on_result is not None:
            on_result(results[-1])

    with torch.inference_mode():
        calibration = calibrate(loaded, calibration_texts, chunk_tokens=settings.chunk_tokens)
        exact = logits()
        report(timed({"impl": "exact", "top1_agreement": 1.0, "mean_kl": 0.0}))
        _, experts = moe_experts(model)[0]
        _, hidden = experts.gate_up_proj.shape[1:]
        ffn = experts.down_proj.shape[2]
        backend = get_backend(TORCH_STATIC)
        costs = MeasuredCosts(backend.measure_costs(hidden, ffn, experts.gate_up_proj.dtype, DEFAULT_GROUP_SIZE),
                              hidden, ffn, measured_on=f"{backend.name} on {machine()}")
        for scale in settings.scales:
            for overflow in OVERFLOWS:
                plan = make_plan(scaled(calibration, scale), model=loaded.name, model_key=loaded.key)
                runtime = MoeRuntime(model, backend, plan, overflow=overflow,
                                     residency=decide_residency(plan, backend, costs, ACCELERATOR))
                try:
                    row = {"impl": f"npumoe-{backend.name}-{overflow}", "capacity_scale": scale, "overflow": overflow,
                           "tiers": list(plan.tiers), **agreement(logits(), exact),
                           **dispatch_fractions(runtime.stats)}
                    report(timed(row))
                finally:
                    runtime.detach()
    return results


def scaled(calibration: Calibration, scale: float) -> Calibration:
    """The calibration with every expert's 95th-percentile load (what the planner sizes capacity for)
    multiplied by `scale`."""
    return replace(calibration, layers=tuple(
        (name, replace(load, p95=tuple(value * scale for value in load.p95))) for name, load in calibration.layers))


def agreement(logits: torch.Tensor, exact: torch.Tensor) -> dict[str, float]:
    """Top-1 agreement and mean KL(exact ‖ engine) over positions, from (T, V) logits."""
    if logits.shape != exact.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and exact logits {tuple(exact.shape)} differ in shape")
    log_p, log_q = F.log_softmax(exact.double(), dim=-1), F.log_softmax(logits.double(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return {"top1_agreement": float((logits.argmax(-1) == exact.argmax(-1)).double().mean()),
            "mean_kl": float(kl.mean())}
