"""Where whole-model prefill time goes: each part's time at each depth of the document, beside its roofline.

Forward hooks on the model's modules (no model code is patched) time each part exclusively: a part's time
leaves out the parts nested in it, so the parts add up to the whole chunk. The parts:
- experts: the routed-experts modules; router: the modules beside them that choose experts;
- dense FFN: dense layers' MLPs and shared experts;
- projections: every linear layer inside an attention module (QKV/O, and latent projections where a
  family has them), whether torch's or the engine's own in its place (engine/attach/projections.py);
- attention: the rest of an attention module: scores, softmax, values, rotary embeddings (the CPU's fused
  SDPA kernel does scores, softmax and values in one call, so they are one part here);
- cache: the KV cache's updates; norms: every normalisation module;
- head: the LM head (a decode step's logits; prefill yields hidden states, so it is zero there);
- other: what no part claims (embedding, residual adds, masks, the engine's own dispatch outside the experts).

Each part's roofline is the larger of its FLOPs at the machine's measured dense-matmul rate and its
bytes at the measured copy bandwidth, both counted from the tensors the part really saw.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from npumoe.engine.attach.projections import HeadRows, ProjectionLinear
from npumoe.engine.generate.prefill import new_cache
from npumoe.engine.loading.model_size import Tensor, tensor_bytes
from npumoe.engine.moe.model_experts import moe_experts

from .timing import interleaved_median_seconds

PARTS = ("experts", "router", "dense_ffn", "projections", "attention", "cache", "norms", "head", "other")
_TIMED_ATTENTION = "npumoe-profiled"


@dataclass
class PartCost:
    seconds: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0

    def roofline_s(self, flop_rate: float, bandwidth: float) -> float | None:
        if not self.flops and not self.bytes:
            return None  # a part whose work is not counted (e.g. linear attention's recurrence)
        return max(self.flops / flop_rate, self.bytes / bandwidth)


@dataclass
class ChunkProfile:
    depth: int  # tokens already in the cache when the chunk started
    tokens: int
    parts: dict[str, PartCost] = field(default_factory=lambda: defaultdict(PartCost))


class PartTimer:
    """Hooks that charge each module's exclusive time, and its counted work, to its part."""

    def __init__(self, model: PreTrainedModel, experts_format: str | None = None) -> None:
        self._experts_format = experts_format
        self._stack: list[tuple[str, float]] = []
        self._chunk: ChunkProfile | None = None
        experts = {name for name, _ in moe_experts(model)}
        head = model.get_output_embeddings()
        self._handles = [handle for name, module in model.named_modules()
                         for handle in self._hook("head" if module is head else _part_of(name, module, experts),
                                                  module)]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    @contextmanager
    def chunk(self, depth: int, tokens: int) -> Iterator[ChunkProfile]:
        self._chunk = ChunkProfile(depth, tokens)
        self._stack = [("other", time.perf_counter())]
        try:
            yield self._chunk
        finally:
            self._leave()
            self._chunk = None

    def enter(self, part: str) -> None:
        if self._chunk is not None:
            self._stack.append((part, time.perf_counter()))

    def leave(self, flops: float = 0.0, nbytes: float = 0.0) -> None:
        if self._chunk is not None:
            cost = self._leave()
            cost.flops += flops
            cost.bytes += nbytes

    def count(self, part: str, flops: float, nbytes: float) -> None:
        """Work done inside a part's time that its hooks cannot see (the attention function's)."""
        if self._chunk is not None:
            self._chunk.parts[part].flops += flops
            self._chunk.parts[part].bytes += nbytes

    def _leave(self) -> PartCost:
        part, started = self._stack.pop()
        elapsed = time.perf_counter() - started
        cost = self._chunk.parts[part]
        cost.seconds += elapsed
        if self._stack:  # exclusive time: the enclosing part does not also count this one
            self._chunk.parts[self._stack[-1][0]].seconds -= elapsed
        return cost

    def _hook(self, part: str | None, module: nn.Module) -> list:
        if part is None:
            return []

        def before(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            self.enter(part)

        def after(mod: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
            self.leave(*_work(part, mod, args, kwargs, self._experts_format))

        return [module.register_forward_pre_hook(before, with_kwargs=True),
                module.register_forward_hook(after, with_kwargs=True)]


def _part_of(name: str, module: nn.Module, experts: set[str]) -> str | None:
    """The part a module's own time is charged to; None leaves it to the nearest enclosing part."""
    parent, _, leaf = name.rpartition(".")
    if name in experts:
        return "experts"
    if any(e.rpartition(".")[0] == parent for e in experts):  # beside the experts, in the MoE block
        return "dense_ffn" if "shared" in leaf else "router"
    if type(module).__name__.endswith("Norm"):
        return "norms"
    if leaf in ("mlp", "feed_forward") and not any(e.startswith(name + ".") for e in experts):
        return "dense_ffn"
    if leaf in ("self_attn", "linear_attn", "attention"):
        return "attention"
    if isinstance(module, (nn.Linear, ProjectionLinear)) and _inside_attention(name):
        return "projections"
    return None


def _inside_attention(name: str) -> bool:
    return any(p.endswith(("self_attn", "linear_attn", "attention")) for p in name.split(".")[:-1])


def _work(part: str, module: nn.Module, args: tuple, kwargs: dict,
          experts_format: str | None = None) -> tuple[float, float]:
    """(FLOPs, bytes) of one call of a part's module, from the tensors it was given: each weight is read
    once and does 2 FLOPs per row; a norm reads and writes its input; the experts' weights are read in
    `experts_format` when the engine runs them quantized. Attention's core is counted in `counted_attention`."""
    x = args[0] if args else next(iter(kwargs.values()), None)
    if not isinstance(x, torch.Tensor) or part in ("attention", "cache", "other"):
        return 0.0, 0.0
    rows = x.shape[:-1].numel()
    if part == "norms":
        return 0.0, 2.0 * x.numel() * x.element_size()
    if part != "experts":
        params, nbytes = _weights(module)
        return 2.0 * rows * params, float(nbytes)
    weights = {name: p for name, p in module.named_parameters() if p.ndim >= 2}
    params = sum(p.numel() for p in weights.values())
    top_k_index = args[1] if len(args) > 1 else kwargs["top_k_index"]
    count = next(p for p in weights.values() if p.ndim == 3).shape[0]
    touched = torch.unique(top_k_index).numel()
    read = sum(p.numel() * p.element_size() if experts_format is None
               else tensor_bytes(Tensor(name, tuple(p.shape), expert=True), experts_format)
               for name, p in weights.items())
    return 2.0 * top_k_index.numel() * params / count, read * touched / count


def _weights(module: nn.Module) -> tuple[int, int]:
    """The elements and bytes of a module's weight matrices: its parameters of two or more dimensions, and the
    weights the engine's projections hold in their kernels' layouts (in their format's bytes)."""
    params = nbytes = 0
    for sub in module.modules():
        if isinstance(sub, ProjectionLinear):
            params += sub.in_features * sub.out_features
            nbytes += sub.weight_nbytes
            continue
        if isinstance(sub, HeadRows):  # the head's Linear, held outside the module tree
            params += sub.weight.numel()
            nbytes += sub.weight.nbytes
            continue
        for p in sub.parameters(recurse=False):
            if p.ndim >= 2:
                params += p.numel()
                nbytes += p.numel() * p.element_size()
    return params, nbytes


@contextmanager
def counted_attention(model: PreTrainedModel, timer: PartTimer) -> Iterator[None]:
    """The model's own attention function, wrapped to count its FLOPs and bytes (its time is attention's)."""
    implementation = model.config._attn_implementation
    inner = ALL_ATTENTION_FUNCTIONS[implementation]

    def counted(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args, **kwargs):
        batch, heads, rows, qk_dim = query.shape
        timer.count("attention", 2.0 * batch * heads * rows * key.shape[-2] * (qk_dim + value.shape[-1]),
                    float(query.numel() + key.numel() + value.numel()) * query.element_size())
        return inner(module, query, key, value, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS.register(_TIMED_ATTENTION, counted)
    ALL_MASK_ATTENTION_FUNCTIONS.register(_TIMED_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS[implementation])
    model.set_attn_implementation(_TIMED_ATTENTION)
    try:
        yield
    finally:
        model.set_attn_implementation(implementation)


def timed_cache(cache: object, timer: PartTimer) -> None:
    """Charge the cache's updates, and the bytes they append, to "cache"."""
    update = cache.update

    def counted(key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        timer.enter("cache")
        try:
            return update(key_states, value_states, *args, **kwargs)
        finally:
            timer.leave(0.0, 2.0 * (key_states.numel() + value_states.numel()) * key_states.element_size())

    cache.update = counted


@torch.inference_mode()
def profile_prefill(model: PreTrainedModel, ids: Sequence[int], chunk_tokens: int, *,
                    experts_format: str | None = None) -> list[ChunkProfile]:
    """Prefill `ids` once in chunks with every part timed; one profile per chunk. `experts_format`: the
    quantized format the engine runs the experts in (their bytes read), None for the model's own dtype."""
    timer = PartTimer(model, experts_format)
    profiles = []
    try:
        with counted_attention(model, timer):
            cache = new_cache(model)
            timed_cache(cache, timer)
            for start in range(0, len(ids), chunk_tokens):
                chunk = torch.tensor([ids[start:start + chunk_tokens]], dtype=torch.long)
                with timer.chunk(start, chunk.shape[1]) as profile:
                    model.base_model(input_ids=chunk, cache=cache, use_cache=True)
                profiles.append(profile)
    finally:
        timer.close()
    return profiles


def machine_rates(model: PreTrainedModel, chunk_tokens: int) -> float:
    """FLOP/s of a dense matmul at the model's width, dtype and chunk length on torch's kernel here."""
    hidden = model.config.hidden_size
    x = torch.randn(chunk_tokens, hidden, dtype=model.dtype)
    w = torch.randn(4 * hidden, hidden, dtype=model.dtype)
    seconds = interleaved_median_seconds({"matmul": lambda: F.linear(x, w)}, warmup=2, repeats=5)["matmul"]
    return 2.0 * chunk_tokens * hidden * 4 * hidden / seconds


def profile_rows(profiles: Sequence[ChunkProfile], depths: Sequence[int], *, flop_rate: float,
                 bandwidth: float) -> list[dict]:
    """One row per (depth, part): the chunk starting nearest each depth, its part times and rooflines."""
    rows = []
    for depth in depths:
        chunk = min(profiles, key=lambda p: abs(p.depth - depth))
        total = sum(cost.seconds for cost in chunk.parts.values())
        for part in PARTS:
            cost = chunk.parts.get(part, PartCost())
            roofline = cost.roofline_s(flop_rate, bandwidth)
            rows.append({"depth": chunk.depth, "chunk_tokens": chunk.tokens, "part": part,
                         "ms": round(cost.seconds * 1e3, 2), "share": round(cost.seconds / total, 3),
                         "roofline_ms": None if roofline is None else round(roofline * 1e3, 2),
                         "x_roofline": None if not roofline else round(cost.seconds / roofline, 1)})
    return rows


def depths_to_report(document_tokens: int, chunk_tokens: int) -> list[int]:
    """The first chunk, and the chunks at 2,048, 8,192, 16,384 and 32,768 tokens deep that the document reaches."""
    last = (document_tokens - 1) // chunk_tokens * chunk_tokens
    return sorted({0, *(d for d in (2048, 8192, 16384, 32768) if d <= last), last})


def run_profile(model: PreTrainedModel, ids: Sequence[int], chunk_tokens: int, *, bandwidth: float,
                experts_format: str | None = None) -> list[dict]:
    """Profile one prefill of `ids` (after one warm-up chunk) and report it at the usual depths."""
    # warm-up: first-call costs out of the way
    list(profile_prefill(model, ids[:chunk_tokens], chunk_tokens, experts_format=experts_format))
    profiles = profile_prefill(model, ids, chunk_tokens, experts_format=experts_format)
    return profile_rows(profiles, depths_to_report(len(ids), chunk_tokens),
                        flop_rate=machine_rates(model, chunk_tokens), bandwidth=bandwidth)
