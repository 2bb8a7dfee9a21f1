"""Real MoE layer geometries, built as the family's own transformers experts module on random weights,
and skewed routing drawn for them.

They let the engine work at a real model's sizes without its checkpoint: `npumoed compile --geometry`
sizes Core ML builds with them, and the measuring tools time layers built from them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from .models import moe_experts


@dataclass(frozen=True)
class Geometry:
    name: str
    family: str  # transformers model_type whose experts class builds the layer
    hidden: int
    experts: int
    top_k: int
    ffn: int  # one expert's intermediate size

    def weight_bytes(self, dtype: torch.dtype) -> int:
        """All experts' weights (gate, up and down) at `dtype`."""
        return self.experts * 3 * self.hidden * self.ffn * torch.finfo(dtype).bits // 8


GEOMETRIES = {g.name: g for g in (
    Geometry("qwen3-30b-a3b", "qwen3_moe", hidden=2048, experts=128, top_k=8, ffn=768),
    Geometry("phi-3.5-moe", "phimoe", hidden=4096, experts=16, top_k=2, ffn=6400),
    Geometry("phi-tiny-moe", "phimoe", hidden=4096, experts=16, top_k=2, ffn=448),
    Geometry("olmoe-1b-7b", "olmoe", hidden=2048, experts=64, top_k=8, ffn=1024),
)}

# Config keys that carry each family's expert count and expert FFN size.
_FAMILY_KEYS = {
    "qwen3_moe": ("num_experts", "moe_intermediate_size"),
    "qwen2_moe": ("num_experts", "moe_intermediate_size"),
    "olmoe": ("num_experts", "intermediate_size"),
    "phimoe": ("num_local_experts", "intermediate_size"),
    "mixtral": ("num_local_experts", "intermediate_size"),
}

_CUSTOM = re.compile(r"(\d+)x(\d+)x(\d+)x(\d+)")


def parse_geometry(text: str) -> Geometry:
    """A named geometry, or a custom Qwen3-MoE one written HIDDENxEXPERTSxTOPKxFFN (e.g. 64x8x2x32)."""
    if text in GEOMETRIES:
        return GEOMETRIES[text]
    match = _CUSTOM.fullmatch(text)
    if not match:
        raise ValueError(f"unknown geometry {text!r}; choose one of {', '.join(GEOMETRIES)} "
                         "or write HIDDENxEXPERTSxTOPKxFFN")
    hidden, experts, top_k, ffn = map(int, match.groups())
    if min(hidden, experts, top_k, ffn) < 1 or top_k > experts:
        raise ValueError(f"geometry {text!r}: sizes must be positive and top-k at most the expert count")
    return Geometry(text, "qwen3_moe", hidden=hidden, experts=experts, top_k=top_k, ffn=ffn)


def family_config(geometry: Geometry, *, layers: int = 1, **overrides: object):
    """The family's transformers config at this geometry (other sizes at the family's defaults)."""
    experts_key, ffn_key = _FAMILY_KEYS[geometry.family]
    settings = {"hidden_size": geometry.hidden, experts_key: geometry.experts, ffn_key: geometry.ffn,
                "num_experts_per_tok": geometry.top_k, "num_hidden_layers": layers, **overrides}
    return AutoConfig.for_model(geometry.family, **settings)


@torch.no_grad()
def build_layer_model(geometry: Geometry, dtype: torch.dtype, generator: torch.Generator) -> PreTrainedModel:
    """A one-layer model of the family at this geometry whose only real part is its experts module.

    Everything else stays on the meta device and is never run: the experts module is driven directly,
    and the model is only there so implementations can be selected the way transformers does it
    (`set_experts_implementation`). Expert weights are random, scaled to keep outputs O(1).
    """
    config = family_config(geometry, experts_implementation="eager")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config).eval()
    experts = layer_experts(model)
    experts.to_empty(device="cpu")
    experts.to(dtype)
    for weight, fan_in in ((experts.gate_up_proj, geometry.hidden), (experts.down_proj, geometry.ffn)):
        for e in range(geometry.experts):  # one expert at a time: no full-size fp32 temporary
            weight[e] = torch.randn(weight.shape[1:], generator=generator) / fan_in**0.5
    return model


def layer_experts(model: PreTrainedModel) -> nn.Module:
    """The experts module of a one-layer model."""
    return moe_experts(model)[0][1]


def routing_prior(geometry: Geometry, generator: torch.Generator, *, skew: float = 1.0) -> torch.Tensor:
    """(E,) log popularity of each expert: a Zipf prior, the r-th most popular weighing 1/r^skew,
    the ranks in random order."""
    if skew < 0:
        raise ValueError(f"routing skew must be >= 0, got {skew}")
    rank = torch.randperm(geometry.experts, generator=generator) + 1
    return -skew * rank.double().log()


def draw_routing(log_prior: torch.Tensor, tokens: int, top_k: int,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(top_k_index (T, k), top_k_weights (T, k) float32) drawn under `log_prior`.

    Router logits are the log prior plus Gumbel noise, so each token's top-k is k distinct experts
    drawn in proportion to popularity; the weights are the softmax over the chosen logits.
    """
    if tokens < 1:
        raise ValueError(f"routing needs at least one token, got {tokens}")
    uniform = torch.rand(tokens, log_prior.numel(), generator=generator, dtype=torch.float64)
    gumbel = -(-uniform.clamp_min(1e-12).log()).log()
    logits, index = torch.topk(log_prior + gumbel, top_k, dim=-1)
    return index, torch.softmax(logits, dim=-1).float()
