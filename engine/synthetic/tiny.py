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
    DeepseekV2Config,
    DeepseekV3Config,
    DeepseekV4Config,
    Ernie4_5_MoeConfig,
    GenerationConfig,
    Glm4MoeConfig,
    Glm4MoeLiteConfig,
    GptOssConfig,
    GraniteMoeConfig,
    GraniteMoeSharedConfig,
    Lfm2MoeConfig,
    MixtralConfig,
    NemotronHConfig,
    OlmoeConfig,
    PhimoeConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)

from ..moe.experts_layout import expert_weights
from ..moe.model_experts import moe_layouts
from .byte_tokenizer import build_byte_tokenizer

HIDDEN = 64
EXPERT_FFN = 32
LAYERS = 3
CONTEXT = 1024

# Router skew: the shared embedding direction's size (in units of the per-dimension noise) and how
# far apart, in logits, the hottest and the coldest expert sit along it.
SHARED_DIRECTION = 4.0
ROUTER_SPREAD = 8.0
# Families whose routers need a wider spread for the same skew: Nemotron-H's MoE layers sit after Mamba and
# attention layers, which keep less of the shared direction.
WIDER_ROUTER_SPREAD = {"nemotron_h": 3 * ROUTER_SPREAD}
BIAS_SCALE = 0.1  # expert biases, where a family has them

MOE_FFN = dict(moe_intermediate_size=EXPERT_FFN, intermediate_size=4 * HIDDEN)  # routed experts, dense layers
# DeepSeek's multi-head latent attention, small: the low-rank query and key-value, and the rotary part of a head
LATENT_ATTENTION = dict(kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                        num_key_value_heads=4)

# (config class, family-specific settings); experts and top-k follow each family's own pattern, every layer MoE.
ARCHITECTURES: dict[str, tuple[type[PretrainedConfig], dict]] = {
    "qwen3_moe": (Qwen3MoeConfig, dict(num_experts=32, num_experts_per_tok=8, moe_intermediate_size=EXPERT_FFN,
                                       intermediate_size=4 * HIDDEN, head_dim=HIDDEN // 4, norm_topk_prob=True)),
    "qwen2_moe": (Qwen2MoeConfig, dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=EXPERT_FFN,
                                       shared_expert_intermediate_size=2 * HIDDEN, intermediate_size=4 * HIDDEN)),
    "mixtral": (MixtralConfig, dict(num_local_experts=16, num_experts_per_tok=2, intermediate_size=EXPERT_FFN)),
    "olmoe": (OlmoeConfig, dict(num_experts=32, num_experts_per_tok=8, intermediate_size=EXPERT_FFN)),
    "phimoe": (PhimoeConfig, dict(num_local_experts=16, num_experts_per_tok=2, intermediate_size=EXPERT_FFN)),
    "granitemoe": (GraniteMoeConfig, dict(num_local_experts=16, num_experts_per_tok=2, intermediate_size=EXPERT_FFN)),
    # a shared MLP beside the routed experts
    "granitemoeshared": (GraniteMoeSharedConfig, dict(num_local_experts=16, num_experts_per_tok=2,
                                                      intermediate_size=EXPERT_FFN,
                                                      shared_intermediate_size=2 * HIDDEN)),
    "deepseek_v2": (DeepseekV2Config, dict(n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=2,
                                           first_k_dense_replace=0, **MOE_FFN, **LATENT_ATTENTION)),
    "deepseek_v3": (DeepseekV3Config, dict(n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
                                           n_group=4, topk_group=2, first_k_dense_replace=0, **MOE_FFN,
                                           **LATENT_ATTENTION)),
    "glm4_moe": (Glm4MoeConfig, dict(n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
                                     first_k_dense_replace=0, head_dim=HIDDEN // 4, **MOE_FFN)),
    # a clamp limit the tiny model's activations reach, so that the clamps are exercised
    "gpt_oss": (GptOssConfig, dict(num_local_experts=16, num_experts_per_tok=4, intermediate_size=EXPERT_FFN,
                                   head_dim=HIDDEN // 4, sliding_window=48, swiglu_limit=1.0,
                                   rope_parameters=dict(rope_type="default", rope_theta=150000.0))),
    "qwen3_next": (Qwen3NextConfig, dict(num_experts=16, num_experts_per_tok=4,
                                         shared_expert_intermediate_size=2 * HIDDEN, head_dim=HIDDEN // 4,
                                         linear_num_key_heads=2, linear_num_value_heads=4,
                                         linear_key_head_dim=16, linear_value_head_dim=16,
                                         layer_types=["linear_attention", "full_attention", "linear_attention"],
                                         **MOE_FFN)),
    "ernie4_5_moe": (Ernie4_5_MoeConfig, dict(num_experts=16, num_experts_per_tok=4, moe_num_shared_experts=1,
                                              moe_layer_start_index=0, **MOE_FFN)),
    "glm4_moe_lite": (Glm4MoeLiteConfig, dict(n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
                                              mlp_layer_types=["sparse"] * LAYERS, **MOE_FFN, **LATENT_ATTENTION)),
    # DeepSeek-V4's compressed and sparse attention at a small size, its window shorter than the prompts
    "deepseek_v4": (DeepseekV4Config, dict(num_local_experts=16, num_experts_per_tok=4, intermediate_size=EXPERT_FFN,
                                           num_key_value_heads=1, head_dim=32, qk_rope_head_dim=4, q_lora_rank=32,
                                           o_lora_rank=32, o_groups=2, index_n_heads=4, index_head_dim=16,
                                           sliding_window=48)),
    # hybrid: short-convolution layers beside attention, each with its own kind of cache
    "lfm2_moe": (Lfm2MoeConfig, dict(num_experts=16, num_experts_per_tok=4, num_dense_layers=0,
                                     layer_types=["conv", "full_attention", "conv"], **MOE_FFN)),
    # hybrid Mamba-attention, experts without a gate (squared ReLU); its layers listed by kind, three of them MoE
    # (its experts twice as wide, so that the up projection fills the bf16 kernel's 64-row blocks), Mamba first
    # as in NVIDIA's checkpoints (transformers 5.25 reads the cache's length off the first layer's)
    "nemotron_h": (NemotronHConfig, dict(n_routed_experts=16, num_experts_per_tok=2,
                                         moe_intermediate_size=2 * EXPERT_FFN,
                                         moe_shared_expert_intermediate_size=2 * HIDDEN, intermediate_size=4 * HIDDEN,
                                         layers_block_type=["mamba", "moe", "attention", "moe", "moe"],
                                         mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
                                         head_dim=HIDDEN // 4, use_mamba_kernels=False)),
}


def make_tiny(arch: str, out_dir: Path, *, seed: int = 0) -> Path:
    """Write a tiny `arch` checkpoint with the project's byte tokenizer to `out_dir`; return the folder."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    tokenizer = build_byte_tokenizer()
    config_class, family_settings = ARCHITECTURES[arch]
    common = dict(vocab_size=len(tokenizer), hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=CONTEXT, tie_word_embeddings=False,
                  bos_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    config = config_class(**{**common, **family_settings})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_skewed(model, torch.Generator().manual_seed(seed), WIDER_ROUTER_SPREAD.get(arch, ROUTER_SPREAD))
    model.generation_config = GenerationConfig(
        do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@torch.no_grad()
def _init_skewed(model: torch.nn.Module, generator: torch.Generator, spread: float) -> None:
    """Embeddings with a shared direction, experts with unit-gain weights, routers leaning along it, the
    hottest expert's router `spread` logits further than the coldest's."""
    hidden = model.config.hidden_size
    shared = torch.randn(hidden, generator=generator)
    shared /= shared.norm()
    embeddings = model.get_input_embeddings().weight
    embeddings.copy_(torch.randn(embeddings.shape, generator=generator) + SHARED_DIRECTION * shared)
    for name, experts, layout in moe_layouts(model):
        weights = expert_weights(experts, layout)
        n_experts, ffn = len(weights), weights.ffn
        gate_up, down = weights.source
        gate_up.copy_(torch.randn(gate_up.shape, generator=generator) / hidden**0.5)
        down.copy_(torch.randn(down.shape, generator=generator) / ffn**0.5)
        for weight_name, bias in experts.named_parameters(recurse=False):
            if weight_name.endswith("_bias"):  # small but not zero, so that a bias the engine dropped would show
                bias.copy_(BIAS_SCALE * torch.randn(bias.shape, generator=generator))
        # Expert ranked r (a random order per layer) leans spread * (1 - r / E) along `shared`.
        lean = spread * (1 - torch.arange(n_experts) / n_experts)
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
