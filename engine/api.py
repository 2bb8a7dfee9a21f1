"""The engine's high-level API: one document in, a summary, embeddings and run statistics out.

`Engine` loads a model, attaches the engine's runtime to it (backends, plan, weights format) and chooses the
prefill chunk length; the work itself is done in generate/: the summarizer maps over a document's sections and
reduces their summaries (generate/summarizer.py), the embedder makes the chunk vectors, in the same prefill
for a document and alone for a search query (generate/embedder.py). Nothing is truncated: a document longer
than the model's context is summarised in sections, then their summaries combined.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from .attach.runtime import MoeRuntime, dense_refusal
from .backends.base import BackendOptions
from .backends.placement import CostCache, place
from .backends.registry import backend_class, get_backend
from .errors import ModelError
from .generate.checks import Check, checked
from .generate.chunk_length import ChunkChoice, measured_chunk_tokens
from .generate.embedder import Embedder, rows
from .generate.pooling import check_pooling, prefill_pooling
from .generate.prefill import new_cache, prefill, windows
from .generate.quality import CheckedText
from .generate.summarizer import Progress, Run, Summarizer, SummaryPrompts
from .loading.load import LoadedModel, load_model
from .moe.dispatch import DispatchStats
from .moe.model_experts import expert_layouts
from .plan.expert_plan import ExpertPlan, PlanError
from .vocabulary import (
    AUTO,
    CHUNK_TOKENS,
    COMPUTE_UNITS,
    CPU,
    DEFAULT_COMPUTE_UNITS,
    DTYPES,
    MEAN,
    MEASURED,
    OVERFLOW_POLICIES,
    PREFILL,
    PROMPT,
    QUANTIZED,
    RESIDENCY_POLICIES,
    SPILL,
    SUMMARY_TOKENS,
    WEIGHTS,
    WEIGHTS_DTYPE,
    weights_with_dtype,
)

# Progress is made by the summarizer; callers take it from here with the rest of the API.
__all__ = ["DocumentResult", "Engine", "EngineSettings", "Progress", "RunStats"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSettings:
    model: str  # local path or Hugging Face id
    backend: str = CPU  # one of vocabulary.BACKENDS
    plan: Path | None = None  # ExpertPlan JSON; None -> exact cpu path, no tiers
    # prefill chunk length; 0: the length measured fastest here (chunk_length.py); a plan's own takes precedence
    chunk_tokens: int = CHUNK_TOKENS
    overflow: str = SPILL  # one of vocabulary.OVERFLOW_POLICIES: what happens to assignments over a tier's capacity
    # The float part of `weights` (vocabulary.WEIGHTS_DTYPE), filled in from it; None while auto is undecided.
    # Given with weights left auto it pins the format (float32: fp32, bfloat16: bf16); beside a weights format
    # whose float part differs it is an error.
    dtype: str | None = None
    # One of vocabulary.WEIGHTS: auto is decided at load by the machine (auto_weights.py); fp32 and bf16 run every
    # weight in that dtype; int8 and int4 quantize the experts on the CPU path and keep the rest in bf16.
    weights: str = AUTO
    threads: int | None = None  # torch intra-op threads; None = leave as is
    trust_remote_code: bool = False
    allow_download: bool = False
    summary_tokens: int = SUMMARY_TOKENS  # max new tokens for the summary
    # longest section summarised on its own (its chunks attend to nothing before it); 0: as long as the context allows
    section_tokens: int = 0
    compiled_dir: Path | None = None  # where `npumoed compile` put the Core ML graphs; the coreml backend needs it
    coreml_compute_units: str = DEFAULT_COMPUTE_UNITS  # one of vocabulary.COMPUTE_UNITS
    costs_dir: Path | None = None  # where the backend's measured costs are cached; None: measure at every load
    # the home's models folder: int8/int4 experts that `npumoed model quantize` wrote there are read, not made again
    models_dir: Path | None = None
    pooling: str = MEAN  # one of vocabulary.POOLINGS: how chunk vectors are made (chosen by `bench retrieval`)
    # one of vocabulary.RESIDENCY_POLICIES: measured (groups run where they cost less) or accelerator (every group a
    # static backend can build runs on it, whatever the costs say: to run and see the planned path anywhere)
    residency: str = MEASURED

    def __post_init__(self) -> None:
        check_pooling(self.pooling)
        backend_class(self.backend).check(self.backend_options)  # an unknown name, or options it cannot run with
        if self.coreml_compute_units not in COMPUTE_UNITS:
            raise ValueError(f"coreml_compute_units must be one of {', '.join(COMPUTE_UNITS)}, "
                             f"got {self.coreml_compute_units!r}")
        if self.overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"overflow must be one of {', '.join(OVERFLOW_POLICIES)}, got {self.overflow!r}")
        if self.residency not in RESIDENCY_POLICIES:
            raise ValueError(f"residency must be one of {', '.join(RESIDENCY_POLICIES)}, got {self.residency!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")
        try:
            object.__setattr__(self, "weights", weights_with_dtype(self.weights, self.dtype))
        except ValueError as e:
            raise ValueError(f"{e}: give weights alone") from None
        if self.weights != AUTO:  # auto is decided at load (Engine.load), the dtype with it
            object.__setattr__(self, "dtype", WEIGHTS_DTYPE[self.weights])
        if self.summary_tokens < 1:
            raise ValueError(f"summary_tokens must be positive, got {self.summary_tokens}")
        for name, zero in (("chunk_tokens", "measured"), ("section_tokens", "as long as the context allows")):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be 0 ({zero}) or positive, got {getattr(self, name)}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be positive or None, got {self.threads}")

    @property
    def backend_options(self) -> BackendOptions:
        return BackendOptions(compiled_dir=self.compiled_dir, compute_units=self.coreml_compute_units,
                              weights=self.weights)


@dataclass(frozen=True)
class RunStats:
    """What one `process` call did and how long its phases took. The settings it ran with are the engine's
    (`Engine.settings`, `Engine.model_key`), so they are not repeated here."""

    tokens: int  # document tokens, every one of them read (nothing is truncated)
    chunks: int  # prefill chunks that held document tokens: one embedding row each
    chunk_tokens: int  # the prefill chunk length used (a plan's own takes precedence over the settings')
    sections: int  # parts the document was cut into to fit the model's context
    reduce_rounds: int  # rounds of combining section summaries; 0 for a one-section document
    generated_tokens: int  # tokens the model wrote for summaries and combines, thinking it was not asked for included
    seconds: dict[str, float]  # wall seconds: "prefill", "summary", "reduce", and "total" for the whole call
    dispatch: DispatchStats  # the MoE layer calls of this run's prefill (decode steps are not counted)
    quality: tuple[CheckedText, ...]  # each section summary and combine, in the order written: how it passed the check


@dataclass
class DocumentResult:
    summary: str
    embeddings: np.ndarray  # float32, (n_chunks + 1, hidden): one L2-normalised row per chunk, last = document
    spans: np.ndarray  # int64, (n_chunks, 2): each chunk's [start, end) character offsets in the text
    stats: RunStats


class Engine:
    """The model attached to the engine's runtime, and the two things done with it: a summarizer and an embedder."""

    def __init__(self, settings: EngineSettings, loaded: LoadedModel, plan: ExpertPlan | None) -> None:
        self.settings = settings
        self.loaded = loaded
        self.plan = plan
        backend = get_backend(settings.backend, settings.backend_options)
        if not expert_layouts(loaded.model) and (why := dense_refusal(loaded.model, backend.name, backend.static,
                                                                      plan is not None)):
            raise ModelError(f"{loaded.name}: {why}")
        cache = CostCache(settings.costs_dir) if settings.costs_dir is not None else None
        # where the plan's groups run on this backend, here
        self.residency = (place(plan, backend, loaded.model, cache, settings.residency, settings.weights)
                          if plan is not None else None)
        # the engine runs the model only through its runtime, so the packed experts are the one copy kept
        quantized = settings.weights if settings.weights in QUANTIZED else None
        self.runtime = MoeRuntime(loaded.model, backend, plan, settings.overflow, self.residency,
                                  quantized=quantized, release=True)
        prompts = SummaryPrompts.fit(loaded, settings.summary_tokens, settings.section_tokens)
        # how the chunk length was chosen: measured here (the timings), or given by the plan or the settings (None)
        self.chunk_choice: ChunkChoice | None = None
        if plan is not None:
            self.chunk_tokens = plan.chunk_tokens
        elif settings.chunk_tokens:
            self.chunk_tokens = settings.chunk_tokens
        else:
            self.chunk_choice = measured_chunk_tokens(loaded.model, loaded.key, section_tokens=prompts.section_tokens,
                                                      threads=torch.get_num_threads())
            self.chunk_tokens = self.chunk_choice.chunk_tokens
        self.embedder = Embedder(loaded, self.runtime, prompts.summarize.prefix, chunk_tokens=self.chunk_tokens,
                                 section_tokens=prompts.section_tokens)
        self.summarizer = Summarizer(loaded, self.runtime, prompts, self.embedder, chunk_tokens=self.chunk_tokens,
                                     summary_tokens=settings.summary_tokens)
        self._dispatch = DispatchStats()  # the last `process` or `logits` call's

    @classmethod
    def load(cls, settings: EngineSettings) -> Engine:
        """The engine for `settings`; `weights = "auto"` is decided here, and the engine's settings hold the
        format it chose."""
        if settings.threads is not None:
            torch.set_num_threads(settings.threads)
        if settings.weights == AUTO:
            settings = _auto_weights(settings)
        plan = ExpertPlan.load(settings.plan) if settings.plan is not None else None
        # experts packed as they are read, in the format the runtime runs: every one on the CPU without a plan, and
        # the placed groups too on a backend that runs them over that copy; only graphs made from float weights
        # (Core ML's, CUDA's) need the experts loaded unpacked first
        pack = plan is None or not backend_class(settings.backend).graphs_from_float
        loaded = load_model(settings.model, trust_remote_code=settings.trust_remote_code,
                            allow_download=settings.allow_download, dtype=settings.dtype, pack=pack,
                            format=settings.weights if settings.weights in QUANTIZED else None,
                            models_dir=settings.models_dir)
        if plan is not None and plan.model_key.rpartition("@")[2] != loaded.key.rpartition("@")[2]:
            raise PlanError(f"{settings.plan}: calibrated for {plan.model_key}, not for {loaded.key}")
        return cls(settings, loaded, plan)

    @property
    def section_tokens(self) -> int:
        """The longest section summarised on its own: `section_tokens`, or what the context allows."""
        return self.summarizer.prompts.section_tokens

    @property
    def model_key(self) -> str:
        return self.loaded.key

    @property
    def stats(self) -> DispatchStats:
        """Dispatch counts of the last `process` or `logits` call (so far, while it runs); a text embedded meanwhile
        counts apart (`embedder.stats`)."""
        return self._dispatch

    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        """(N, V) logits of `ids` by chunked prefill from an empty cache through the engine."""
        self._dispatch = DispatchStats()
        with self.runtime.counting(self._dispatch):
            cache = new_cache(self.loaded.model)
            return torch.cat(list(prefill(self.loaded.model, ids, self.chunk_tokens, cache, logits=True)))

    def process(self, text: str, on_progress: Callable[[Progress], None] | None = None,
                check: Check | None = None) -> DocumentResult:
        """Summary, embeddings and stats for one document. `on_progress` is told after every chunk and summary.
        `check` runs before every MoE layer, so within one layer of each prefill chunk and each decode step of
        the summaries and combines: it may block (a pause) or raise (a stop, which propagates)."""
        encoded = self.embedder.encode(text)
        doc = encoded["input_ids"]
        run = Run(on_progress, tokens_total=len(doc))
        pooling = self.settings.pooling
        sections = windows(doc, self.section_tokens)
        self._dispatch = DispatchStats()
        with self.runtime.counting(self._dispatch), checked(self.loaded.model, check):
            vectors, sizes, summaries = self.summarizer.map(sections, run, prefill_pooling(pooling))
            if pooling == PROMPT:
                tick = time.perf_counter()
                vectors = self.embedder.one_word_vectors(doc, sizes)
                run.seconds[PREFILL] += time.perf_counter() - tick
            summary, rounds = self.summarizer.reduce(summaries, run)
        run.seconds["total"] = time.perf_counter() - run.started
        stats = RunStats(tokens=len(doc), chunks=len(sizes), chunk_tokens=self.chunk_tokens,
                         sections=len(sections), reduce_rounds=rounds, generated_tokens=run.generated_tokens,
                         seconds=run.seconds, dispatch=self._dispatch, quality=tuple(run.quality))
        return DocumentResult(summary=summary, embeddings=rows(vectors, sizes),
                              spans=self.embedder.spans(encoded, sizes), stats=stats)

    def embed(self, text: str, pooling: str | None = None) -> np.ndarray:
        """(H,) float32 vector of a text, such as a search query, made exactly as a document's vector is (`pooling`,
        default the settings'): in the same chunks, the token-weighted mean of their vectors, L2-normalised. No
        summary is decoded, and the counts of a document being processed are left alone."""
        return self.embedder.embed(text, pooling or self.settings.pooling)

    def embed_document(self, text: str, pooling: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(embeddings, spans) of a document as `process` makes them, with `pooling` (default the settings'), and
        no summary: what `npumoed bench retrieval` compares the poolings on."""
        return self.embedder.embed_document(text, pooling or self.settings.pooling)

    def close(self) -> None:
        """Detach the engine from the model (its experts implementation goes back to what it was). The model's
        own expert weights were released when the engine packed them: it cannot run its experts without one."""
        self.runtime.detach()


def _auto_weights(settings: EngineSettings) -> EngineSettings:
    """`settings` with the weights format `auto` stands for on this machine, said in the log."""
    from .loading.auto_weights import choose_model_weights

    name, choice = choose_model_weights(str(settings.model), allow_download=settings.allow_download,
                                        trust_remote_code=settings.trust_remote_code)
    log.info("%s: weights auto -> %s", name, choice.reason)
    return replace(settings, weights=choice.weights)
