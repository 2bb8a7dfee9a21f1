"""Whole-model document prefill throughput: the engine against plain transformers, side by side.

A real transformers causal LM of the geometry's family, with a few layers at the real sizes and the
family's own random initialisation, is built in memory (no download). A document of random token ids
is prefilled in fixed chunks with the KV cache carried across them, through the engine's chunked
prefill, once per implementation: transformers' own experts implementations, and the engine attached
with each backend, and (`weights`) the engine's CPU path with its experts, and its dense projections where that
measures faster, quantized. The engine's plan is calibrated on other random documents.

Before timing, each implementation's hidden states after every decoder layer and at the end, for the whole
document, are checked part by part (against the fp32 model where the dtype rounds: paths.Reference); an exact path
that misses is refused, pruning and quantized paths are marked approximate; the last timed round is checked again.
With `own_process`, transformers also runs in a process of its own under torch's OpenMP defaults
(fair/own_process.py); `peers` add rows of their own (a C++ engine's) to each case.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from transformers import PreTrainedModel

from npumoe.engine.attach.runtime import MoeRuntime
from npumoe.engine.backends.registry import get_backend
from npumoe.engine.calibration.calibrate import Calibration
from npumoe.engine.generate.prefill import new_cache, prefill
from npumoe.engine.loading.load import TORCH_DTYPES
from npumoe.engine.synthetic.geometry import Geometry
from npumoe.engine.vocabulary import CHUNK_TOKENS, CPU, QUANTIZED, SPILL

from .fair.own_process import transformers_elsewhere
from .fair.paired import add_ratios
from .fair.workloads import build_model, in_float32, prefill_parts
from .paths import EnginePath, calibration_from_loads, measure_impls, static_plans
from .profile import run_profile

# More rows for a case, from outside the engine's and transformers' (a C++ peer's): given the case's model, the
# case and the document's token ids, its rows ({"impl", "status", "tokens_per_s", ...}).
# A peer takes the model and one case's timed rows and gives them back with its own rows beside them.
Peer = Callable[[PreTrainedModel, dict, list[dict]], list[dict]]


@dataclass(frozen=True)
class PrefillBenchSettings:
    threads: int
    layers: int = 2
    document_tokens: int = 2048
    chunk_tokens: int = CHUNK_TOKENS
    calibration_documents: int = 2
    warmup: int = 1
    repeats: int = 3
    min_seconds: float = 0.0  # more rounds than `repeats` until the timed ones add up to this
    seed: int = 0
    own_process: bool = False  # also transformers in a process of its own, under torch's OpenMP defaults
    profile: bool = False  # also split the engine's CPU paths' time per part at each depth
    weights: tuple[str, ...] = ()  # quantized formats the engine's CPU path also runs in (vocabulary.QUANTIZED)

    def __post_init__(self) -> None:
        if not set(self.weights) <= set(QUANTIZED):
            raise ValueError(f"quantized weights must be among {', '.join(QUANTIZED)}, got {list(self.weights)}")
        if min(self.threads, self.layers, self.document_tokens, self.chunk_tokens, self.calibration_documents,
               self.repeats) < 1 or self.warmup < 0 or self.min_seconds < 0:
            raise ValueError(f"every size and count must be positive (warmup, min_seconds >= 0), got {self}")
        if self.chunk_tokens > self.document_tokens:
            raise ValueError(f"chunk length {self.chunk_tokens} is longer than the document "
                             f"({self.document_tokens} tokens)")


def run_prefill_bench(geometries: Sequence[Geometry], dtypes: Sequence[str], settings: PrefillBenchSettings, *,
                      bandwidth: float | None = None, peers: Sequence[Peer] = (),
                      on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """One row per (geometry, dtype, implementation): document tokens/s and the ratio to transformers' best;
    with `settings.profile`, also one row per (depth, part) of the engine's CPU path (`impl` "profile"),
    its rooflines priced at `bandwidth` (bytes/s). Each of `peers` adds its rows to every case."""
    if settings.profile and bandwidth is None:
        raise ValueError("a profile needs the machine's measured bandwidth")
    unknown = [d for d in dtypes if d not in TORCH_DTYPES]
    if unknown:
        raise ValueError(f"dtypes must be among {', '.join(TORCH_DTYPES)}, got {unknown}")
    results: list[dict] = []
    with torch.inference_mode():
        for geometry in geometries:
            for dtype_name in dtypes:
                model = build_model(geometry, settings.layers, TORCH_DTYPES[dtype_name],
                                    context=settings.document_tokens, seed=settings.seed)
                case = {"geometry": geometry.name, "layers": settings.layers, "dtype": dtype_name,
                        "document_tokens": settings.document_tokens, "chunk_tokens": settings.chunk_tokens,
                        "threads": settings.threads}
                rows = _bench_model(model, geometry, dtype_name, settings, case, peers)
                if settings.profile:
                    rows += [{"impl": "profile", **row} for row in _profile(model, settings, bandwidth)]
                for row in rows:
                    results.append({**case, **row})
                    if on_result is not None:
                        on_result(results[-1])
                del model
                gc.collect()
    return results


def _bench_model(model: PreTrainedModel, geometry: Geometry, dtype_name: str, settings: PrefillBenchSettings,
                 case: dict, peers: Sequence[Peer]) -> list[dict]:
    generator = torch.Generator().manual_seed(settings.seed)
    vocab = model.config.vocab_size

    def document() -> list[int]:
        return torch.randint(vocab, (settings.document_tokens,), generator=generator).tolist()

    plans = static_plans(calibrate_on_documents(model, [document() for _ in range(settings.calibration_documents)],
                                    settings.chunk_tokens),
                         model=geometry.name, hidden=geometry.hidden, ffn=geometry.ffn, dtype=model.dtype)
    ids = document()
    spec = {"kind": "prefill", "geometry": geometry.name, "layers": settings.layers, "dtype": dtype_name,
            "context": settings.document_tokens, "seed": settings.seed, "ids": ids,
            "chunk_tokens": settings.chunk_tokens, "threads": settings.threads}
    with transformers_elsewhere(spec, settings.own_process) as elsewhere:
        run = partial(prefill_parts, model, ids, settings.chunk_tokens)
        # prefill runs the base model alone: the LM head need not be cast up for the truth
        truth = None if model.dtype == torch.float32 else partial(in_float32, model.base_model, run)
        rows = measure_impls(model, plans, run, truth=truth,
                             first=lambda: next(iter(prefill(model, ids, settings.chunk_tokens, new_cache(model)))),
                             tokens=len(ids), warmup=settings.warmup, repeats=settings.repeats,
                             min_seconds=settings.min_seconds, elsewhere=elsewhere, weights=settings.weights)
    for peer in peers:
        rows = peer(model, case, rows)
    return add_ratios(rows)


def _profile(model: PreTrainedModel, settings: PrefillBenchSettings, bandwidth: float) -> list[dict]:
    """The engine's exact CPU path (the daemon's default), then its quantized paths, on a fresh document, part by
    part; each row names the path it profiled."""
    generator = torch.Generator().manual_seed(settings.seed + 1)
    ids = torch.randint(model.config.vocab_size, (settings.document_tokens,), generator=generator).tolist()
    rows = []
    for path in (EnginePath(CPU, SPILL), *(EnginePath(CPU, SPILL, format) for format in settings.weights)):
        runtime = MoeRuntime(model, get_backend(CPU), quantized=path.weights)
        try:
            rows += [{"profiled": path.impl, **row}
                     for row in run_profile(model, ids, settings.chunk_tokens, bandwidth=bandwidth,
                                            experts_format=path.weights)]
        finally:
            runtime.detach()
    return rows


def calibrate_on_documents(model: PreTrainedModel, documents: list[list[int]], chunk_tokens: int) -> Calibration:
    """Expert loads of every full chunk of `documents`, recorded on the engine's exact path."""
    runtime = MoeRuntime(model, get_backend(CPU))
    try:
        with runtime.recording_loads() as loads:
            full = []
            for ids in documents:
                for chunk in prefill(model, ids, chunk_tokens, new_cache(model)):
                    full.append(chunk.shape[0] == chunk_tokens)
    finally:
        runtime.detach()
    return calibration_from_loads([(name, torch.stack(calls)[torch.tensor(full)])
                                   for name, calls in zip(runtime.names, loads, strict=True)],
                                  chunk_tokens=chunk_tokens, source=f"{len(documents)} random-token documents")
