"""Sizing Core ML builds without a checkpoint: random-weight layers and a plan at a real MoE geometry.

The plan comes from the engine's own planner, calibrated on Zipf-skewed routing draws, so its tiers
and groups have the shape a real calibration gives; the weights are random at the true sizes, so
conversion time and package sizes are those of the real model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..calibration.calibrate import Calibration, load_statistics
from ..calibration.planner import DEFAULT_GROUP_SIZE, make_plan
from ..moe.experts_layout import DEFAULT_LAYOUT, ExpertsLayout, ExpertWeights, expert_weights, read_layout
from ..plan.expert_plan import ExpertPlan
from ..vocabulary import CHUNK_TOKENS
from .geometry import Geometry, build_layer_model, draw_routing, layer_experts, routing_prior

CALIBRATION_CHUNKS = 16


@dataclass(frozen=True)
class SizingModel:
    plan: ExpertPlan
    weights: list[ExpertWeights]  # per layer, fp16
    layout: ExpertsLayout


def sizing_model(geometry: Geometry, *, layers: int = 1, chunk_tokens: int = CHUNK_TOKENS,
                 group_size: int = DEFAULT_GROUP_SIZE, seed: int = 0) -> SizingModel:
    """`layers` random MoE layers at `geometry` and a plan for them."""
    if layers < 1:
        raise ValueError(f"need at least one layer, got {layers}")
    generator = torch.Generator().manual_seed(seed)
    weights, loads, layout = [], [], DEFAULT_LAYOUT
    for layer in range(layers):
        model = build_layer_model(geometry, torch.float16, generator)
        experts = layer_experts(model)
        layout = read_layout(f"layers.{layer}.mlp.experts", experts)
        weights.append(expert_weights(experts, layout))
        prior = routing_prior(geometry, generator)
        draws = [draw_routing(prior, chunk_tokens, geometry.top_k, generator)[0] for _ in range(CALIBRATION_CHUNKS)]
        counts = torch.stack([torch.bincount(index.reshape(-1), minlength=geometry.experts) for index in draws])
        loads.append((f"layers.{layer}.mlp.experts", load_statistics(counts.float())))
    calibration = Calibration(chunk_tokens=chunk_tokens, tokens=chunk_tokens * CALIBRATION_CHUNKS,
                              chunks=CALIBRATION_CHUNKS, sources=(f"zipf-routing(seed={seed})",), layers=tuple(loads))
    plan = make_plan(calibration, model=geometry.name, model_key=f"{geometry.name}@random-{seed}",
                     group_size=group_size)
    return SizingModel(plan=plan, weights=weights, layout=layout)
