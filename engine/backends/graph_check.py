"""The accuracy gate for accelerator graphs: a group graph is trusted only once it has computed what the CPU does.

Each graph a backend would place runs once on a probe against the exact CPU path (`CpuExperts`) on the same
experts' weights (the engine's packed copy where it holds one), as the kernel choice probes a CPU kernel before
timing it. The probe is a few seeded rows per expert, one of them scaled to the largest input magnitude calibration
saw for that expert (where the plan recorded magnitudes), since overflow is what an fp16 graph gets wrong first.
A graph whose outputs are not finite, or whose relative error is over its format's bound, is refused with its
measured error and its group stays on the CPU.
"""

from __future__ import annotations

import torch

from ..formats.quantize import error_bound, relative_error
from ..moe.cpu_experts import CpuExperts
from ..plan.expert_plan import ExpertMagnitudes
from .base import Backend, GroupSpec

PROBE_ROWS = 4  # filled rows per expert; the rest of its capacity is padding, whose outputs are never read
# Graph and CPU path round differently over a whole expert (two projections and the activation): this many units
# of the format's per-kernel bound.
GRAPH_SLACK = 4.0


def graph_bound(backend: Backend, dtype: torch.dtype) -> float:
    """The relative error a group graph of `backend` may have against the exact CPU path on weights of `dtype`."""
    return GRAPH_SLACK * error_bound(torch.float16 if backend.fp16 else dtype)


def probe_input(spec: GroupSpec, magnitudes: ExpertMagnitudes | None, experts: tuple[int, ...]) -> torch.Tensor:
    """A (G, C, H) probe for the group: PROBE_ROWS seeded rows per expert (fewer where C is smaller), its first row
    scaled so its largest value is the largest input magnitude calibration saw for that expert; zeros elsewhere."""
    weights = spec.weights
    rows = min(PROBE_ROWS, spec.capacity)
    generator = torch.Generator().manual_seed(0)
    x = torch.zeros(len(weights), spec.capacity, weights.hidden, dtype=weights.down.dtype)
    filled = torch.randn(len(weights), rows, weights.hidden, generator=generator)
    if magnitudes is not None:
        peaks = torch.tensor([magnitudes.activation[e] for e in experts])
        filled[:, 0] *= (peaks / filled[:, 0].abs().amax(dim=-1)).unsqueeze(-1)
    x[:, :rows] = filled.to(x.dtype)
    return x


@torch.inference_mode()
def graph_refusal(backend: Backend, spec: GroupSpec, magnitudes: ExpertMagnitudes | None,
                  experts: tuple[int, ...]) -> str | None:
    """Why the group's graph on `backend` may not be placed (its outputs on the probe are not finite, or too far from
    the exact CPU path's), or None when it computes what the CPU does."""
    x = probe_input(spec, magnitudes, experts)
    rows = min(PROBE_ROWS, spec.capacity)
    try:
        graph = backend.build_spec(spec)
    except (OSError, ValueError, KeyError) as e:  # no graph compiled for it, or one that does not load
        return f"its graph cannot be built: {e}"
    got = graph(x)[:, :rows]
    cpu, ids = spec.packed if spec.packed is not None else (CpuExperts(spec.weights, spec.layout),
                                                            tuple(range(len(spec.weights))))
    exact = torch.stack([cpu(e, x[g, :rows]) for g, e in enumerate(ids)])
    if not bool(torch.isfinite(got).all()):
        return "its outputs on the probe are not finite"
    error, bound = relative_error(got, exact), graph_bound(backend, spec.weights.down.dtype)
    if not error <= bound:  # a NaN error is refused too
        return f"relative error {error:.3g} against the CPU path, above its bound {bound:.3g}"
    return None
