"""What the weights' format costs on a real model and real text: perplexity, top-1 agreement and KL against float.

The model (the demo MoE, or any checkpoint) runs in fp32 over the start of each sample document, first with its own
weights (the float model), then with its experts' weights rounded to each format and back (int8 per output row,
int4 in groups of a chosen size, `quantize.py`): the experts are what `weights = "int8"` / `"int4"` quantize; the
rest (attention, embeddings, router) stays float. This measures the formats' rounding alone, with exact fp32
activations: the floor every kernel of a format sits on (bench/fidelity/weights.py measures the kernels on top).

The demo's float weights come from a Q4_1 GGUF file, so they sit (to bf16's rounding) on a 4-bit grid of 32-weight
blocks along each row: int4 in groups of 32 aligned with those blocks can find that grid again and reproduces them
almost exactly, which says nothing about how int4 does on a model trained in float. Groups of 64 each hold two of
the file's blocks with their own scales and offsets, which one 16-level grid cannot follow: that row is what int4
costs a float model. `weight_errors` says how far each format's expert weights sit from the checkpoint's and, where
the GGUF file is at hand, from the file's own dequantized values.

Two rows give the floor the formats are judged against, what moves the top-1 of this model without any integer
format: the float model computed in bf16 (every activation and weight in bf16, as `weights = "bf16"` runs it), and,
where the GGUF file is at hand, the experts given the file's exact values instead of the checkpoint's bf16 rounding of
them (a 0.1 % weight change). A small model whose next token is often a near tie flips some of them under any change.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from npumoe.engine.formats.quantize import INT4, INT4_GROUP, INT8, quantize
from npumoe.engine.generate.prefill import new_cache, prefill, windows
from npumoe.engine.loading.load import LoadedModel
from npumoe.engine.moe.model_experts import moe_experts

from .capacity import agreement

GGUF_BLOCK = 32  # weights per Q4_0 / Q4_1 block: the grid the demo's float weights sit on


@dataclass(frozen=True)
class Variant:
    """One way to hold the experts' weights: float (format None), int8, or int4 in groups of `group`."""

    name: str
    format: str | None = None
    group: int = INT4_GROUP
    meaning: str = ""
    compute: torch.dtype = torch.float32  # the dtype the whole model runs in
    exact_experts: bool = False  # the experts take the GGUF file's own values (needs the file)


FLOAT = Variant("float", meaning="the checkpoint's own weights: the reference")
VARIANTS = (
    FLOAT,
    Variant("int8", INT8, meaning="one scale per output row"),
    Variant(f"int4 g{GGUF_BLOCK} aligned", INT4, GGUF_BLOCK,
            meaning="the engine's int4, its groups on the file's Q4_1 blocks: finds the file's grid again"),
    Variant(f"int4 g{2 * GGUF_BLOCK} not aligned", INT4, 2 * GGUF_BLOCK,
            meaning="two of the file's blocks a group: what int4 costs a model not already on a 4-bit grid"),
)
FLOORS = (
    Variant("float in bf16", compute=torch.bfloat16,
            meaning="the float weights, every activation in bf16: what bf16 rounding alone moves"),
    Variant("experts as in the GGUF", exact_experts=True,
            meaning="the file's exact values, not their bf16 rounding: a 0.1 % weight change"),
)
TARGETS = {INT8: {"top1": 0.99, "perplexity": 0.01}, INT4: {"top1": 0.95, "perplexity": 0.05}}  # issue #29


@dataclass(frozen=True)
class RealFidelitySettings:
    chunk_tokens: int = 256
    tokens_per_document: int = 1024  # the first this many tokens of each document

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1 or self.tokens_per_document < 2:
            raise ValueError(f"need a positive chunk and at least two tokens a document, got {self}")


def run_real_fidelity(loaded: LoadedModel, texts: Sequence[str], settings: RealFidelitySettings, *,
                      variants: Sequence[Variant] = VARIANTS + FLOORS, dense: dict[str, torch.Tensor] | None = None,
                      on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """One row per variant (the first is the float reference): perplexity over `texts`' first tokens, its change
    against float, top-1 agreement and mean KL(float ‖ variant), and the experts' weight errors (`weight_errors`)."""
    if loaded.model.dtype != torch.float32:
        raise ValueError(f"the float model must run in fp32, got {loaded.model.dtype}")
    ids = [piece for text in texts
           if len(piece := loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
                  [:settings.tokens_per_document]) >= 2]
    if not ids:
        raise ValueError("the texts need at least two tokens each")
    rows: list[dict] = []
    reference: list[torch.Tensor] = []
    with torch.inference_mode():
        for variant in variants:
            if variant.exact_experts and dense is None:
                continue  # the GGUF file is not at hand, or the model did not come from one
            with (rounded_experts(loaded.model, variant, dense) as originals,
                  computed_in(loaded.model, variant.compute) as kept):
                logits = [document_logits(loaded, piece, settings.chunk_tokens) for piece in ids]
                before = {name: kept.get(name, weight) for name, weight in originals.items()}  # before the cast too
                errors = weight_errors(loaded.model, before, dense)
            reference = reference or logits
            row = {"variant": variant.name, "format": variant.format or "float",
                   "group": variant.group if variant.format == INT4 else None, "meaning": variant.meaning,
                   "documents": len(ids), "tokens": sum(map(len, ids)), "perplexity": perplexity(logits, ids),
                   **agreement(torch.cat(logits), torch.cat(reference)), **errors}
            row["perplexity_change"] = row["perplexity"] / rows[0]["perplexity"] - 1 if rows else 0.0
            rows.append(row)
            if on_result is not None:
                on_result(row)
    return rows


def document_logits(loaded: LoadedModel, ids: Sequence[int], chunk_tokens: int) -> torch.Tensor:
    """(T, V) next-token logits of one document, prefilled in windows of the model's context."""
    window = max(1, loaded.context_tokens // chunk_tokens) * chunk_tokens
    return torch.cat([chunk.float() for piece in windows(ids, window)
                      for chunk in prefill(loaded.model, piece, chunk_tokens, new_cache(loaded.model), logits=True)])


def perplexity(logits: Sequence[torch.Tensor], ids: Sequence[Sequence[int]]) -> float:
    """exp of the mean cross-entropy of each document's next tokens (every position but the last predicts one)."""
    losses = [F.cross_entropy(doc[:-1].double(), torch.tensor(piece[1:]), reduction="sum")
              for doc, piece in zip(logits, ids, strict=True)]
    return math.exp(float(sum(losses)) / sum(len(piece) - 1 for piece in ids))


def expert_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every routed-experts module's (E, N, K) weights (gate-up and down projections), by qualified name."""
    return {f"{name}.{param}": weight for name, module in moe_experts(model)
            for param, weight in module.named_parameters(recurse=False) if weight.ndim == 3}


@contextmanager
def rounded_experts(model: torch.nn.Module, variant: Variant,
                    dense: dict[str, torch.Tensor] | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """The model with its experts' weights rounded to `variant`'s format and back to their dtype (or, for a variant
    of exact experts, every expert given the dense model's `dense` weights), put back after; yields the float
    originals (what the changed weights are compared with; the weights themselves for a variant that leaves them:
    a copy of every expert is the largest allocation of the run)."""
    weights = expert_weights(model)
    changes = variant.exact_experts or variant.format is not None
    originals = {name: weight.detach().clone() if changes else weight for name, weight in weights.items()}
    try:
        with torch.no_grad():
            for name, weight in weights.items():
                if variant.exact_experts:
                    weight.copy_(dense[name].expand_as(weight))  # upcycled: every expert is the dense FFN
                elif variant.format is not None:
                    _round(weight, variant)
        yield originals
    finally:
        with torch.no_grad():
            for name, weight in weights.items():
                if changes:
                    weight.copy_(originals[name])


@contextmanager
def computed_in(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[dict[str, torch.Tensor]]:
    """The model cast to `dtype` and back after; what the cast would not give back exactly (a weight finer than
    `dtype`, the rotary frequencies) is kept aside and put back as it was. Yields what was kept, by name."""
    if dtype == model.dtype:
        yield {}
        return
    float_dtype = model.dtype
    kept = {name: tensor.detach().clone() for name, tensor in [*model.named_parameters(), *model.named_buffers()]
            if tensor.is_floating_point() and not torch.equal(tensor, tensor.to(dtype).to(tensor.dtype))}
    model.to(dtype)
    try:
        yield kept
    finally:
        model.to(float_dtype)
        with torch.no_grad():
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                if name in kept:
                    tensor.copy_(kept[name])


def _round(weight: torch.Tensor, variant: Variant) -> None:
    """Each expert's (N, K) slice rounded in place; an upcycled expert equal to the one before reuses its rounding."""
    for e in range(weight.shape[0]):
        if e and torch.equal(weight[e], weight[e - 1]):
            weight[e] = weight[e - 1]  # already rounded: equal before, so equal after
            continue
        weight[e] = quantize(weight[e], variant.format, group=variant.group).dequantize(weight.dtype)


def weight_errors(model: torch.nn.Module, originals: dict[str, torch.Tensor],
                  dense: dict[str, torch.Tensor] | None) -> dict[str, float]:
    """Relative L2 error of the experts' current weights against the checkpoint's (`originals`) and, given the
    dense model's FFN weights (`dense`, keyed like `expert_weights`, (N, K) each), against those (expert 0's)."""
    weights = expert_weights(model)
    errors = {"weight_error": _relative_error([(weights[n], originals[n]) for n in weights])}
    if dense is not None:
        errors["weight_error_vs_gguf"] = _relative_error([(weights[n][0], w) for n, w in dense.items()])
    return errors


def _relative_error(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """‖approximate − exact‖ / ‖exact‖ over all the (approximate, exact) pairs together, one pair at a time (the
    experts' weights are GBs: no concatenated or float64 copy of them all)."""
    difference = sum(float((a.float() - e.float()).square().sum(dtype=torch.float64)) for a, e in pairs)
    return math.sqrt(difference / sum(float(e.float().square().sum(dtype=torch.float64)) for _, e in pairs))


def gguf_dense_ffn(gguf_file: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The dense Llama GGUF's FFN weights dequantized to fp32, keyed like the upcycled MoE's `expert_weights`:
    layer i's gate and up stacked (Mixtral's gate-up projection), and its down projection."""
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(gguf_file).tensors}

    def read(name: str) -> torch.Tensor:
        tensor = tensors[name]
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        return torch.from_numpy(values.reshape([int(n) for n in reversed(tensor.shape)]).copy()).float()

    dense = {}
    for name in expert_weights(model):
        i = _layer_index(name)
        if name.endswith("gate_up_proj"):
            dense[name] = torch.cat([read(f"blk.{i}.ffn_gate.weight"), read(f"blk.{i}.ffn_up.weight")])
        elif name.endswith("down_proj"):
            dense[name] = read(f"blk.{i}.ffn_down.weight")
    return dense


def _layer_index(name: str) -> int:
    """The decoder layer a qualified parameter name is in (`model.layers.7.mlp.experts.down_proj` -> 7)."""
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1])
