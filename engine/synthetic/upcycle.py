"""Sparse upcycling: a dense Llama-architecture model made a Mixtral-class MoE whose output is the dense model's.

Every layer's FFN becomes `experts` copies of itself, and a router picks `top_k` of them per token. Mixtral's router
renormalises its weights over the top-k, so the weighted sum of identical experts is the dense FFN's output: the
MoE computes what the dense model does, while its routing, dispatch, tiers and groups do real work.

The router is built from the model's own hidden states, so its loads are skewed the way trained routers' are: each
layer's FFN inputs on some text, less their mean, are clustered by direction (spherical k-means), and each router
row points at one cluster's centre. Clusters of real activations are uneven, and so are the experts' loads; on top,
each router row leans along the direction every token shares, by an amount that falls with the expert's rank in a
per-layer order, so some experts are popular everywhere, as in trained MoEs (a hot expert takes several times a
cold one's tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    MixtralConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

EXPERTS = 8  # Mixtral's count: enough experts for tiers and groups to differ
# One expert per token: each token costs what the dense model's FFN does (top-2 would double it for the same output,
# since the renormalised weight of one expert is exactly 1), and the loads stay as skewed as the router makes them.
TOP_K = 1
# Stored in bfloat16, the engine's 16-bit dtype: half fp32's disk, build and load time. Rounding the file's Q4_1
# values to bf16's 8-bit mantissa moves them by up to 2^-9 relative; the MoE still equals the dense model with the
# same rounded weights (tests/demo/test_demo_model.py).
DTYPE = torch.bfloat16
ROUTER_TOKENS = 1024  # of each text, for the clustering: enough for stable centres, cheap to run
ROUTER_LOGITS = 4.0  # a typical token's largest logit: most tokens clearly belong to one expert
ROUTER_SPREAD = 2.0  # logits between the most and the least popular expert's lean
KMEANS_ROUNDS = 25


def upcycle_gguf(gguf: Path, out_dir: Path, texts: Sequence[str], *, experts: int = EXPERTS, top_k: int = TOP_K,
                 seed: int = 0) -> Path:
    """Read a dense Llama GGUF, upcycle it with a router built on `texts`, and save the MoE and its tokenizer
    (chat template included) to `out_dir` as a Hugging Face folder; return it."""
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    dense = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    rows = router_rows(dense, tokenizer, texts, experts, seed=seed)
    moe = upcycle(dense, rows, top_k).to(DTYPE)
    moe.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def upcycle(dense: PreTrainedModel, rows: Sequence[torch.Tensor], top_k: int) -> PreTrainedModel:
    """The Mixtral-class MoE of `dense` (a Llama), each layer's router weight `rows[layer]` (E, H)."""
    c = dense.config
    experts = rows[0].shape[0]
    config = MixtralConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_parameters=c.rope_parameters, tie_word_embeddings=c.tie_word_embeddings, sliding_window=None,
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id,
        num_local_experts=experts, num_experts_per_tok=top_k, router_jitter_noise=0.0)
    with torch.device("meta"):
        moe = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    weights = {}
    for name, tensor in dense.state_dict().items():
        layer, _, rest = name.removeprefix("model.layers.").partition(".mlp.")
        if not rest:
            weights[name] = tensor
            continue
        mlp = dense.model.layers[int(layer)].mlp
        prefix = f"model.layers.{layer}.mlp"
        if rest == "gate_proj.weight":
            # A copy per expert: safetensors cannot store one tensor under several names (see the README).
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])  # (2I, H), gate first as Mixtral's
            weights[f"{prefix}.experts.gate_up_proj"] = gate_up.repeat(experts, 1, 1)
            weights[f"{prefix}.experts.down_proj"] = mlp.down_proj.weight.repeat(experts, 1, 1)
            weights[f"{prefix}.gate.weight"] = rows[int(layer)].float()
    if c.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    moe.load_state_dict(weights, strict=False, assign=True)
    if c.tie_word_embeddings:
        moe.tie_weights()
    missing = [n for n, p in moe.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"upcycling left parameters unset: {missing[:4]}")
    moe.generation_config = GenerationConfig(do_sample=False, bos_token_id=c.bos_token_id,
                                             eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id)
    return moe.eval()


@torch.no_grad()
def router_rows(dense: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], experts: int,
                *, seed: int = 0) -> list[torch.Tensor]:
    """Per layer, (E, H) router rows: the directions of E clusters of the layer's FFN inputs on `texts`."""
    inputs: list[list[torch.Tensor]] = [[] for _ in dense.model.layers]
    hooks = [layer.mlp.register_forward_pre_hook(lambda _, args, i=i: inputs[i].append(args[0][0]))
             for i, layer in enumerate(dense.model.layers)]
    try:
        for text in texts:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"][:ROUTER_TOKENS]
            dense(torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    generator = torch.Generator().manual_seed(seed)
    return [_cluster_directions(torch.cat(layer), experts, generator) for layer in inputs]


def _cluster_directions(x: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """(k, H) router rows from FFN inputs x (N, H): spherical k-means on the inputs less their mean and off the
    mean's direction (which every token shares, so it cannot tell experts apart), scaled to ROUTER_LOGITS, plus
    each expert's lean along that shared direction."""
    mean = x.mean(0)
    along = mean / mean.norm()
    lean = ROUTER_SPREAD * (1 - torch.arange(k) / (k - 1))[torch.randperm(k, generator=generator)]  # (k,)
    deviation = x - mean
    deviation -= (deviation @ along)[:, None] * along
    units = torch.nn.functional.normalize(deviation, dim=-1)
    centres = units[torch.randperm(len(units), generator=generator)[:k]].clone()
    for _ in range(KMEANS_ROUNDS):
        nearest = (units @ centres.T).argmax(-1)
        for e in range(k):
            members = units[nearest == e]
            # an emptied cluster restarts at a random token, so every expert keeps a direction
            centres[e] = members.sum(0) if len(members) else units[torch.randint(len(units), (1,), generator=generator)]
        centres = torch.nn.functional.normalize(centres, dim=-1)
    # x @ along is about |mean| for every token: the lean adds about `lean` logits to each expert
    return centres * (ROUTER_LOGITS / deviation.norm(dim=-1).median()) + lean[:, None] * along / mean.norm()
