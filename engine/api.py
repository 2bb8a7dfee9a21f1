"""The engine's high-level API: one document in, a summary, embeddings and run statistics out.

A document is tokenized and cut into sections that fit the model's context with the summary
prompt around them, and at most `section_tokens` long where that is set: a shorter section is
prefilled at a shallower attention depth, at the price of more summaries to decode and combine.
Each section is prefilled chunk by chunk (fixed chunk length, the KV cache carried across chunks)
and summarised by greedy decoding from the prefilled cache. With more than one section the section
summaries are combined (map, then reduce, repeated until one is left): a long document is never
silently truncated. Embeddings are one vector per chunk, pooled from its final hidden states as
`pooling` says (generate/pooling.py), and the document's, their token-weighted mean, all L2-normalised;
`embed` makes a search query's vector the same way, so queries and chunks share one space.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .attach.runtime import MoeRuntime
from .backends.base import BackendOptions
from .backends.placement import CostCache, place
from .backends.registry import backend_class, get_backend
from .generate.checks import Check, checked
from .generate.chunk_length import ChunkChoice, measured_chunk_tokens
from .generate.pooling import OneWordFrame, check_pooling, pooled, prefill_pooling
from .generate.prefill import new_cache, prefill, windows
from .generate.summary import (
    COMBINE,
    OUTLINE_WORDS,
    SUMMARIZE,
    PromptFrame,
    answer_tokens,
    decode_from_cache,
    echoes,
    joined_lines,
    opening,
    outline,
    stop_ids,
    whole_sentences,
    without_thinking,
)
from .loading.load import LoadedModel, load_model
from .moe.dispatch import DispatchStats
from .plan.expert_plan import ExpertPlan, PlanError
from .vocabulary import (
    AUTO,
    CHUNK_TOKENS,
    COMPUTE_UNITS,
    CPU,
    DEFAULT_COMPUTE_UNITS,
    DTYPES,
    MEAN,
    OVERFLOW_POLICIES,
    PHASES,
    PREFILL,
    PROMPT,
    QUANTIZED,
    REDUCE,
    SPILL,
    SUMMARY,
    SUMMARY_TOKENS,
    WEIGHTS,
    WEIGHTS_DTYPE,
    weights_with_dtype,
)

log = logging.getLogger(__name__)

_SENTENCE_START = re.compile(r"(?:\A|(?<=[.!?]\s)|(?<=\n))[A-Z0-9\"']")


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

    def __post_init__(self) -> None:
        check_pooling(self.pooling)
        backend_class(self.backend).check(self.backend_options)  # an unknown name, or options it cannot run with
        if self.coreml_compute_units not in COMPUTE_UNITS:
            raise ValueError(f"coreml_compute_units must be one of {', '.join(COMPUTE_UNITS)}, "
                             f"got {self.coreml_compute_units!r}")
        if self.overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"overflow must be one of {', '.join(OVERFLOW_POLICIES)}, got {self.overflow!r}")
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


@dataclass
class Progress:
    phase: str  # one of vocabulary.PHASES
    chunks_done: int
    chunks_total: int
    tokens_done: int  # document tokens prefilled
    tokens_total: int
    elapsed_s: float


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


@dataclass
class DocumentResult:
    summary: str
    embeddings: np.ndarray  # float32, (n_chunks + 1, hidden): one L2-normalised row per chunk, last = document
    spans: np.ndarray  # int64, (n_chunks, 2): each chunk's [start, end) character offsets in the text
    stats: RunStats


@dataclass
class _Run:
    """Bookkeeping for one `process` call."""

    on_progress: Callable[[Progress], None] | None
    tokens_total: int
    tokens_done: int = 0
    generated_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    def report(self, phase: str, done: int, total: int) -> None:
        if self.on_progress is not None:
            self.on_progress(Progress(phase, done, total, self.tokens_done, self.tokens_total,
                                      time.perf_counter() - self.started))


class Engine:
    def __init__(self, settings: EngineSettings, loaded: LoadedModel, plan: ExpertPlan | None) -> None:
        self.settings = settings
        self.loaded = loaded
        self.plan = plan
        backend = get_backend(settings.backend, settings.backend_options)
        cache = CostCache(settings.costs_dir) if settings.costs_dir is not None else None
        # where the plan's groups run on this backend, here
        self.residency = place(plan, backend, loaded.model, cache) if plan is not None else None
        # the engine runs the model only through its runtime, so the packed experts are the one copy kept
        quantized = settings.weights if settings.weights in QUANTIZED else None
        self.runtime = MoeRuntime(loaded.model, backend, plan, settings.overflow, self.residency,
                                  quantized=quantized, release=True)
        tokenizer = loaded.tokenizer
        self._summarize = PromptFrame.build(tokenizer, SUMMARIZE)
        self._combine = PromptFrame.build(tokenizer, COMBINE)
        self._one_word = OneWordFrame.build(tokenizer)
        self._separator = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
        spacing = len(self._separator) + len(self._label(999))  # between two summaries in a combine's input
        self._stop = stop_ids(loaded.model, tokenizer)
        if not self._stop:
            raise ValueError(f"{loaded.name}: neither the model nor the tokenizer names an end-of-sequence token")
        context, n = loaded.context_tokens, settings.summary_tokens
        fits = context - self._summarize.overhead - n
        self._section_tokens = min(fits, settings.section_tokens) if settings.section_tokens else fits
        self._reduce_tokens = context - self._combine.overhead - n
        # Each reduce round must at least halve the summaries, or a long document would never finish.
        if self._reduce_tokens < 2 * (n + spacing) or self._section_tokens < 1:
            raise ValueError(f"summary_tokens={n} is too large for {loaded.name}'s context of {context} tokens "
                             f"(at most {(context - self._combine.overhead - 2 * spacing) // 3})")
        # how the chunk length was chosen: measured here (the timings), or given by the plan or the settings (None)
        self.chunk_choice: ChunkChoice | None = None
        if plan is not None:
            self.chunk_tokens = plan.chunk_tokens
        elif settings.chunk_tokens:
            self.chunk_tokens = settings.chunk_tokens
        else:
            self.chunk_choice = measured_chunk_tokens(loaded.model, loaded.key, section_tokens=self._section_tokens,
                                                      threads=torch.get_num_threads())
            self.chunk_tokens = self.chunk_choice.chunk_tokens

    @classmethod
    def load(cls, settings: EngineSettings) -> Engine:
        """The engine for `settings`; `weights = "auto"` is decided here, and the engine's settings hold the
        format it chose."""
        if settings.threads is not None:
            torch.set_num_threads(settings.threads)
        if settings.weights == AUTO:
            settings = _auto_weights(settings)
        plan = ExpertPlan.load(settings.plan) if settings.plan is not None else None
        # without a plan every expert runs on the CPU: packed as it is read, in the format the runtime runs
        loaded = load_model(settings.model, trust_remote_code=settings.trust_remote_code,
                            allow_download=settings.allow_download, dtype=settings.dtype, pack=plan is None,
                            format=settings.weights if settings.weights in QUANTIZED else None,
                            models_dir=settings.models_dir)
        if plan is not None and plan.model_key.rpartition("@")[2] != loaded.key.rpartition("@")[2]:
            raise PlanError(f"{settings.plan}: calibrated for {plan.model_key}, not for {loaded.key}")
        return cls(settings, loaded, plan)

    @property
    def section_tokens(self) -> int:
        """The longest section summarised on its own: `section_tokens`, or what the context allows."""
        return self._section_tokens

    @property
    def model_key(self) -> str:
        return self.loaded.key

    @property
    def stats(self) -> DispatchStats:
        """Dispatch counts since the last `process` or `logits` call began."""
        return self.runtime.stats

    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        """(N, V) logits of `ids` by chunked prefill from an empty cache through the engine."""
        self.runtime.stats = DispatchStats()
        cache = new_cache(self.loaded.model)
        return torch.cat(list(prefill(self.loaded.model, ids, self.chunk_tokens, cache, logits=True)))

    def process(self, text: str, on_progress: Callable[[Progress], None] | None = None,
                check: Check | None = None) -> DocumentResult:
        """Summary, embeddings and stats for one document. `on_progress` is told after every chunk and summary.
        `check` runs before every MoE layer, so within one layer of each prefill chunk and each decode step of
        the summaries and combines: it may block (a pause) or raise (a stop, which propagates)."""
        if not text.strip():
            raise ValueError("document text is empty or whitespace only: nothing to process")
        tokenizer = self.loaded.tokenizer
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=tokenizer.is_fast)
        doc = encoded["input_ids"]
        run = _Run(on_progress, tokens_total=len(doc))
        self.runtime.stats = DispatchStats()

        pooling = self.settings.pooling
        sections = windows(doc, self._section_tokens)
        with checked(self.loaded.model, check):
            vectors, sizes, summaries = self._map(sections, run, prefill_pooling(pooling))
            if pooling == PROMPT:
                tick = time.perf_counter()
                vectors = self._one_word_vectors(doc, sizes)
                run.seconds[PREFILL] += time.perf_counter() - tick
            summary, rounds, combined = self._reduce(summaries, run)

        run.seconds["total"] = time.perf_counter() - run.started
        stats = RunStats(tokens=len(doc), chunks=len(sizes), chunk_tokens=self.chunk_tokens,
                         sections=len(sections), reduce_rounds=rounds, generated_tokens=run.generated_tokens,
                         seconds=run.seconds,
                         dispatch=self.runtime.stats)
        said = whole_sentences(joined_lines(tokenizer.decode(summary, skip_special_tokens=True)))
        if rounds:  # and what each part that went into the last combine is about
            said += "\n\n" + outline([joined_lines(tokenizer.decode(part, skip_special_tokens=True))
                                       for part in combined])
        return DocumentResult(summary=said,
                              embeddings=_rows(vectors, sizes), spans=self._spans(encoded, sizes), stats=stats)

    def _map(self, sections: list[Sequence[int]], run: _Run,
             pooling: str) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
        """Prefill each section after the prompt prefix, pooling the document tokens of every chunk, then
        decode the section's summary from the cache. The prefix shares the first chunk, so no step is
        a mostly empty launch.

        Returns (n_chunks, H) pooled final hidden states per chunk, (n_chunks,) document tokens per chunk,
        and each section's summary tokens."""
        prefix = self._summarize.prefix  # only its length counts here: _pool_chunks puts it before each section
        chunks_total = sum(math.ceil((len(prefix) + len(section)) / self.chunk_tokens) for section in sections)
        chunks_done = 0
        vectors: list[torch.Tensor] = []
        sizes: list[int] = []
        summaries: list[list[int]] = []
        for section in sections:
            tick = time.perf_counter()
            cache = new_cache(self.loaded.model)
            for chunk in self._pool_chunks(section, cache, pooling):
                chunks_done += 1
                if chunk is not None:
                    vector, size = chunk
                    vectors.append(vector)
                    sizes.append(size)
                    run.tokens_done += size
                run.report(PREFILL, chunks_done, chunks_total)
            run.seconds[PREFILL] += time.perf_counter() - tick
            tick = time.perf_counter()
            summaries.append(self._section_summary(section, cache, run))
            run.seconds[SUMMARY] += time.perf_counter() - tick
            run.report(SUMMARY, len(summaries), len(sections))
        stacked = torch.stack(vectors)
        return stacked, torch.tensor(sizes, dtype=torch.float32, device=stacked.device), summaries

    def _section_summary(self, section: Sequence[int], cache: Any, run: _Run) -> list[int]:
        """The section's summary decoded from `cache`; an answer that only says the instruction back gives way to the
        section's own opening sentences, which say more of what it is about to a reader and to the combine."""
        said = self._decode(self._summarize, section, cache, run)
        tokenizer = self.loaded.tokenizer
        if not echoes(tokenizer.decode(said, skip_special_tokens=True), SUMMARIZE):
            return said
        text = joined_lines(tokenizer.decode(section, skip_special_tokens=True))
        start = _SENTENCE_START.search(text)  # the section's first whole sentence: a section may start mid-sentence
        return tokenizer(opening(text[start.start() if start else 0:], OUTLINE_WORDS),
                         add_special_tokens=False)["input_ids"]

    def _pool_chunks(self, section: Sequence[int], cache: Any,
                     pooling: str) -> Iterator[tuple[torch.Tensor, int] | None]:
        """Prefill the summary prompt's prefix then `section` into `cache`, one chunk at a time; for each chunk
        yield the vector (H,) pooled from its section tokens and their count, or None when the chunk holds only
        prefix tokens."""
        prefix = self._summarize.prefix
        position = 0  # in the prefilled stream: prefix, then section
        for hidden in prefill(self.loaded.model, [*prefix, *section], self.chunk_tokens, cache):  # (n, H)
            tokens = hidden[max(0, len(prefix) - position):]  # this chunk's section tokens
            position += hidden.shape[0]
            yield (pooled(tokens, pooling), len(tokens)) if len(tokens) else None

    def _chunk_sizes(self, sections: list[Sequence[int]]) -> torch.Tensor:
        """(n_chunks,) document tokens in each prefill chunk, cut as _pool_chunks cuts them, without prefilling."""
        prefix, step = len(self._summarize.prefix), self.chunk_tokens
        sizes = [min(start + step, prefix + len(s)) - max(start, prefix)
                 for s in sections for start in range(0, prefix + len(s), step)]
        return torch.tensor([n for n in sizes if n > 0], dtype=torch.float32)

    def _one_word_vectors(self, ids: Sequence[int], sizes: torch.Tensor) -> torch.Tensor:
        """(n_chunks, H) PromptEOL vectors: each chunk of `ids` (`sizes` tokens each, in order) alone in the
        one-word prompt, prefilled from an empty cache, the prompt's last hidden state."""
        ends = np.cumsum(sizes.int().tolist())
        vectors = []
        for start, end in zip([0, *ends[:-1]], ends, strict=True):
            *_, hidden = prefill(self.loaded.model, self._one_word.around(ids[start:end]), self.chunk_tokens,
                                 new_cache(self.loaded.model))
            vectors.append(pooled(hidden, PROMPT))
        return torch.stack(vectors)

    def embed(self, text: str, pooling: str | None = None) -> np.ndarray:
        """(H,) float32 vector of a text, such as a search query, made exactly as a document's vector is (`pooling`,
        default the settings'): in the same chunks, the token-weighted mean of their vectors, L2-normalised. No
        summary is decoded."""
        ids = self._encode(text)["input_ids"]
        vectors, sizes = self._vectors(ids, pooling or self.settings.pooling)
        return _rows(vectors, sizes)[-1]

    def embed_document(self, text: str, pooling: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(embeddings, spans) of a document as `process` makes them, with `pooling` (default the settings'), and
        no summary: what `npumoed bench retrieval` compares the poolings on."""
        encoded = self._encode(text)
        vectors, sizes = self._vectors(encoded["input_ids"], pooling or self.settings.pooling)
        return _rows(vectors, sizes), self._spans(encoded, sizes)

    def _encode(self, text: str) -> Any:
        if not text.strip():
            raise ValueError("text is empty or whitespace only: nothing to embed")
        tokenizer = self.loaded.tokenizer
        return tokenizer(text, add_special_tokens=False, return_offsets_mapping=tokenizer.is_fast)

    def _vectors(self, ids: Sequence[int], pooling: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(n_chunks, H) chunk vectors and (n_chunks,) their token counts, by the summary's prefill (its prompt
        prefix, its sections and chunks) without decoding."""
        check_pooling(pooling)
        saved = self.runtime.stats  # a query the daemon embeds between a document's chunks leaves its counts alone
        self.runtime.stats = DispatchStats()
        try:
            sections = windows(ids, self._section_tokens)
            if pooling == PROMPT:
                sizes = self._chunk_sizes(sections)
                return self._one_word_vectors(ids, sizes), sizes
            chunks = [chunk for section in sections
                      for chunk in self._pool_chunks(section, new_cache(self.loaded.model), pooling) if chunk]
            vectors = torch.stack([vector for vector, _ in chunks])
            return vectors, torch.tensor([size for _, size in chunks], dtype=torch.float32, device=vectors.device)
        finally:
            self.runtime.stats = saved

    def _spans(self, encoded: Any, sizes: torch.Tensor) -> np.ndarray:
        """(n_chunks, 2) each chunk's [start, end) characters in the text."""
        token_ends = np.cumsum(sizes.cpu().numpy().astype(np.int64))  # chunks follow each other in the text
        if self.loaded.tokenizer.is_fast:
            return _offset_spans(encoded["offset_mapping"], token_ends)
        return _decoded_spans(self.loaded.tokenizer, encoded["input_ids"], token_ends)

    def _reduce(self, summaries: list[list[int]], run: _Run) -> tuple[list[int], int, list[list[int]]]:
        """Combine summaries, as many at a time as fit the context, until one is left; (it, rounds, the summaries
        the last round combined: the sections' own when one round did)."""
        tick = time.perf_counter()
        rounds = 0
        combined = summaries
        while len(summaries) > 1:
            rounds += 1
            combined = summaries
            # each summary labelled with its place: a small model then combines the parts instead of quoting one
            labelled = [[*self._label(i), *summary] for i, summary in enumerate(summaries, 1)]
            joined = [*labelled[0], *(t for s in labelled[1:] for t in (*self._separator, *s))]
            parts = windows(joined, self._reduce_tokens)
            summaries = []
            for part in parts:
                cache = new_cache(self.loaded.model)
                self._prefill([*self._combine.prefix, *part], cache)
                summaries.append(self._decode(self._combine, part, cache, run))
                run.report(REDUCE, len(summaries), len(parts))
        run.seconds[REDUCE] = time.perf_counter() - tick
        return summaries[0], rounds, combined

    def _label(self, i: int) -> list[int]:
        """What goes before the i-th summary in a combine's input."""
        return self.loaded.tokenizer(f"Part {i}: ", add_special_tokens=False)["input_ids"]

    def _prefill(self, ids: Sequence[int], cache: Any) -> None:
        """Prefill without looking at the output (prompt prefixes, parts to combine)."""
        for _ in prefill(self.loaded.model, ids, self.chunk_tokens, cache):
            pass

    def _decode(self, frame: PromptFrame, text: Sequence[int], cache: Any, run: _Run) -> list[int]:
        with self.runtime.decoding():
            said = decode_from_cache(self.loaded.model, [*frame.prefix, *text, *frame.suffix], cache,
                                     answer_tokens(len(text), self.settings.summary_tokens), self._stop)
        run.generated_tokens += len(said)
        return without_thinking(self.loaded.tokenizer, said)  # reasoning never reaches a summary or a combine

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


def _rows(vectors: torch.Tensor, sizes: torch.Tensor) -> np.ndarray:
    """(n + 1, H) float32: the chunk vectors (n, H) and their token-weighted mean, each L2-normalised."""
    rows = torch.cat([vectors, _token_mean(vectors, sizes)[None]])
    return torch.nn.functional.normalize(rows, dim=-1).cpu().numpy()


def _token_mean(means: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """(H,) mean over every token, from per-chunk means (n, H) and token counts (n,)."""
    return (means * sizes[:, None]).sum(0) / sizes.sum()


def _offset_spans(offsets: Sequence[tuple[int, int]], token_ends: np.ndarray) -> np.ndarray:
    """(n, 2) character spans of consecutive token ranges ending at `token_ends`, from the tokenizer's offsets."""
    starts = np.concatenate([[0], token_ends[:-1]])
    return np.array([[offsets[a][0], offsets[b - 1][1]] for a, b in zip(starts, token_ends, strict=True)],
                    dtype=np.int64).reshape(-1, 2)


def _decoded_spans(tokenizer: Any, ids: Sequence[int], token_ends: np.ndarray) -> np.ndarray:
    """The same for a tokenizer without offsets (a slow, Python one): each chunk's decoded length, added up.
    Approximate where a chunk boundary splits a character or the decoder changes spacing."""
    starts = np.concatenate([[0], token_ends[:-1]])
    lengths = [len(tokenizer.decode(ids[a:b])) for a, b in zip(starts, token_ends, strict=True)]
    ends = np.cumsum(lengths, dtype=np.int64)
    return np.stack([ends - lengths, ends], axis=1).reshape(-1, 2)
