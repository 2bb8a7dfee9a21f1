"""Real MoE model geometries, from their published configs, built as the family's own transformers modules on
random weights, and skewed routing drawn for them.

They let the engine work at a real model's sizes without its checkpoint: `npumoed compile --geometry`
sizes Core ML builds with them, and the measuring tools time layers built from them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.resources import files
from types import MappingProxyType
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from ..moe.model_experts import moe_experts

# Config keys that may carry the routed expert count; families differ in which one they store.
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
# Settings that make every layer an MoE layer, for the one-layer experts model (families that begin with
# dense layers, such as DeepSeek's `first_k_dense_replace`, would otherwise have none).
_EVERY_LAYER_MOE = {"first_k_dense_replace": 0, "mlp_only_layers": [], "decoder_sparse_step": 1}
_PER_LAYER_KEYS = ("layer_types",)  # lists with one entry per layer, cut to the layers built


@dataclass(frozen=True)
class Geometry:
    """A model's sizes as its config.json publishes them (`config` holds `model_type` and every number
    that sets the cost of prefill); what is not given stays at the config class's defaults."""

    name: str
    config: Mapping[str, Any] = field(hash=False)
    checkpoint: str | None = None  # the Hugging Face id the numbers are published with
    params_b: float | None = None  # total parameters its model card states, in billions

    @classmethod
    def sized(cls, name: str, family: str, *, hidden: int, experts: int, top_k: int, ffn: int) -> Geometry:
        """A geometry of `family` given only its MoE sizes, in the keys that family's config stores."""
        defaults = AutoConfig.for_model(family).to_dict()
        experts_key = next(key for key in _EXPERT_COUNT_KEYS if key in defaults)
        ffn_key = "moe_intermediate_size" if "moe_intermediate_size" in defaults else "intermediate_size"
        return cls(name, MappingProxyType({"model_type": family, "hidden_size": hidden, experts_key: experts,
                                           "num_experts_per_tok": top_k, ffn_key: ffn}))

    @property
    def family(self) -> str:
        """The transformers model_type whose classes build the model."""
        return self.config["model_type"]

    @property
    def hidden(self) -> int:
        return self.config["hidden_size"]

    @property
    def experts(self) -> int:
        return next(self.config[key] for key in _EXPERT_COUNT_KEYS if key in self.config)

    @property
    def top_k(self) -> int:
        return self.config["num_experts_per_tok"]

    @property
    def ffn(self) -> int:
        """One routed expert's intermediate size."""
        return self.config.get("moe_intermediate_size", self.config.get("intermediate_size"))

    def weight_bytes(self, dtype: torch.dtype) -> int:
        """One layer's routed experts' weights (gate, up and down) at `dtype`."""
        return self.experts * 3 * self.hidden * self.ffn * torch.finfo(dtype).bits // 8


def _load_geometries() -> dict[str, Geometry]:
    published = json.loads(files(__package__).joinpath("geometries.json").read_text())["geometries"]
    return {name: Geometry(name, MappingProxyType(entry["config"]), entry["checkpoint"], entry["params_b"])
            for name, entry in published.items()}


GEOMETRIES = _load_geometries()

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
    return Geometry.sized(text, "qwen3_moe", hidden=hidden, experts=experts, top_k=top_k, ffn=ffn)


def family_config(geometry: Geometry, *, layers: int | None = None, **overrides: object) -> PretrainedConfig:
    """The family's transformers config at this geometry, with the first `layers` layers of the real model
    (all of them by default): per-layer patterns such as sliding-window or linear-attention layers are cut
    to match."""
    settings = dict(geometry.config)
    if layers is not None:
        settings["num_hidden_layers"] = layers
        for key in _PER_LAYER_KEYS:
            if key in settings:
                settings[key] = list(settings[key])[:layers]
    settings.update(overrides)
    family = settings.pop("model_type")
    return AutoConfig.for_model(family, **settings)


@torch.no_grad()
def build_layer_model(geometry: Geometry, dtype: torch.dtype, generator: torch.Generator) -> PreTrainedModel:
    """A one-layer model of the family at this geometry whose only real part is its experts module.

    Everything else stays on the meta device and is never run: the experts module is driven directly,
    and the model is only there so implementations can be selected the way transformers does it
    (`set_experts_implementation`). Expert weights are random, scaled to keep outputs O(1).
    """
    config = family_config(geometry, layers=1, experts_implementation="eager", **_EVERY_LAYER_MOE)
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
