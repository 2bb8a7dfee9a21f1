"""Seeded tiny random-weight MoE checkpoints of the supported families, for tests and the offline demo.

Each is built from the family's real transformers config class, saved with `save_pretrained`, and
meant to be read back with `load_model`. Routers are initialised skewed, so expert load is uneven
the way it is in trained models: every token embedding shares one direction, and each router row
leans along that direction by an amount that falls with the expert's rank in a per-layer order.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    GraniteMoeConfig,
    MixtralConfig,
    OlmoeConfig,
    PhimoeConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from .models import moe_experts
from .tokenizer import build_byte_tokenizer

HIDDEN = 64
EXPERT_FFN = 32
LAYERS = 3
CONTEXT = 1024

# Router skew: the shared embedding direction's size (in units of the per-dimension noise) and how
# far apart, in logits, the hottest and the coldest expert sit along it.
SHARED_DIRECTION = 4.0
ROUTER_SPREAD = 8.0

# (config class, family-specific settings); experts and top-k follow each family's own pattern.
ARCHITECTURES: dict[str, tuple[type[PretrainedConfig], dict]] = {
    "qwen3_moe": (Qwen3MoeConfig, dict(num_experts=32, num_experts_per_tok=8, moe_intermediate_size=EXPERT_FFN,
                                       intermediate_size=4 * HIDDEN, head_dim=HIDDEN // 4, norm_topk_prob=True)),
    "qwen2_moe": (Qwen2MoeConfig, dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=EXPERT_FFN,
                                       shared_expert_intermediate_size=2 * HIDDEN, intermediate_size=4 * HIDDEN)),
    "mixtral": (MixtralConfig, dict(num_local_experts=16, num_experts_per_tok=2, intermediate_size=EXPERT_FFN)),
    "olmoe": (OlmoeConfig, dict(num_experts=32, num_experts_per_tok=8, intermediate_size=EXPERT_FFN)),
    "phimoe": (PhimoeConfig, dict(num_local_experts=16, num_experts_per_tok=2, intermediate_size=EXPERT_FFN)),
    "granitemoe": (GraniteMoeConfig, dict(num_local_experts=16, num_experts_per_tok=2, intermediate_size=EXPERT_FFN)),
}


def make_tiny(arch: str, out_dir: Path, *, seed: int = 0) -> Path:
    """Write a tiny `arch` checkpoint with the project's byte tokenizer to `out_dir`; return the folder."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    tokenizer = build_byte_tokenizer()
    config_class, family_settings = ARCHITECTURES[arch]
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **family_settings,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_skewed(model, torch.Generator().manual_seed(seed))
    model.generation_config = GenerationConfig(
        do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@torch.no_grad()
def _init_skewed(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Embeddings with a shared direction, experts with unit-gain weights, routers leaning along it."""
    hidden = model.config.hidden_size
    shared = torch.randn(hidden, generator=generator)
    shared /= shared.norm()
    embeddings = model.get_input_embeddings().weight
    embeddings.copy_(torch.randn(embeddings.shape, generator=generator) + SHARED_DIRECTION * shared)
    for name, experts in moe_experts(model):
        n_experts, _, ffn = experts.down_proj.shape
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=generator) / hidden**0.5)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=generator) / ffn**0.5)
        # Expert ranked r (a random order per layer) leans ROUTER_SPREAD * (1 - r / E) along `shared`.
        lean = ROUTER_SPREAD * (1 - torch.arange(n_experts) / n_experts)
        lean = lean[torch.randperm(n_experts, generator=generator)]
        router = _router_weight(model, name, n_experts)
        router.copy_(torch.randn(router.shape, generator=generator) / hidden**0.5
                     + lean[:, None] * shared[None, :] / hidden**0.5)


def _router_weight(model: torch.nn.Module, experts_name: str, n_experts: int) -> torch.nn.Parameter:
    """The (E, H) router weight that sits beside an experts module in its MoE block."""
    block = model.get_submodule(experts_name.rpartition(".")[0])
    for name, param in block.named_parameters():
        if not name.startswith(("experts.", "shared_expert")) and param.shape == (n_experts, model.config.hidden_size):
            return param
    raise ValueError(f"no router weight of shape ({n_experts}, H) beside {experts_name}")
