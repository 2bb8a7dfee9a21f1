"""The host's work around a layer's group graphs: packing token rows into the group buffers and unpacking the graphs'
outputs, per layer call, with every expert resident (forced placement) and graphs that return their input.

This is on the accelerator's critical path whatever the accelerator: the graphs cannot start before their buffers
are packed, and the combine cannot start before their outputs are unpacked. Only the geometry matters (the experts'
FFN width is never read), so the layer is built with FFN 1.
"""

from __future__ import annotations

import torch

from npumoe.engine.kernels.choice import median_seconds
from npumoe.engine.moe.dispatch import MoeLayer, Routed, StaticGroup
from npumoe.engine.moe.experts_layout import ExpertWeights
from npumoe.engine.synthetic.geometry import Geometry, draw_routing, routing_prior

GROUP_SIZE = 8
CAPACITY_MULTIPLE = 32  # each expert's capacity: its load in the drawn routing, padded up as a calibrated tier is


def host_packing_seconds(geometry: Geometry, tokens: int, dtype: torch.dtype, *, seed: int = 0, skew: float = 1.0,
                         repeats: int = 10) -> dict[str, float]:
    """Median seconds of one layer call's packing and unpacking at this geometry: {"pack_s", "unpack_s"}."""
    generator = torch.Generator().manual_seed(seed)
    index, _ = draw_routing(routing_prior(geometry, generator, skew=skew), tokens, geometry.top_k, generator)
    counts = torch.bincount(index.reshape(-1), minlength=geometry.experts)
    capacity = [max(1, -(-int(n) // CAPACITY_MULTIPLE)) * CAPACITY_MULTIPLE for n in counts]
    order = sorted(range(geometry.experts), key=lambda e: -capacity[e])
    groups = [StaticGroup(tuple(order[i:i + GROUP_SIZE]), capacity[order[i]], lambda x: x)
              for i in range(0, geometry.experts, GROUP_SIZE)]
    weights = ExpertWeights(torch.randn(geometry.experts, 2, geometry.hidden, generator=generator).to(dtype),
                            torch.randn(geometry.experts, geometry.hidden, 1, generator=generator).to(dtype))
    layer = MoeLayer(weights, groups=groups)
    x = torch.randn(tokens, geometry.hidden, generator=generator).to(dtype)
    routed = Routed.from_order(index, torch.argsort(index.reshape(-1), stable=True), counts)
    static_counts = layer.static_per_expert(counts)
    packed = layer.pack(x, routed, static_counts)
    outputs = {g: layer.buffer(packed, g) for g in range(len(groups))}  # identity graphs: their outputs
    out = torch.empty(index.numel(), geometry.hidden, dtype=dtype)
    return {"pack_s": median_seconds(lambda: layer.pack(x, routed, static_counts), repeats=repeats),
            "unpack_s": median_seconds(lambda: layer.unpack(out, outputs, routed, static_counts), repeats=repeats)}
