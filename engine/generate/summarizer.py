"""A document's summary: each section's summary decoded from its prefilled cache (map), then combined (reduce).

A document is cut into sections that fit the model's context with the summary prompt around them, and at most
`section_tokens` long where that is set: a shorter section is prefilled at a shallower attention depth, at the
price of more summaries to decode and combine. Each section is prefilled chunk by chunk after the prompt's
prefix, the embedder pooling every chunk on the way (embedder.py), and its summary is decoded greedily from
the cache (summary.py). With more than one section the summaries are combined, as many at a time as fit the
context, round after round until one is left: a long document is never silently truncated.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..attach.runtime import MoeRuntime
from ..loading.load import LoadedModel
from ..vocabulary import PHASES, PREFILL, REDUCE, SUMMARY
from .embedder import Embedder
from .prefill import new_cache, prefill, windows
from .sentences import finished_sentences, from_first_sentence
from .summary import (
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
    text_tokens,
    without_thinking,
)

# What goes before the i-th summary in a combine's input: labelled with its place, a small model combines the
# parts instead of quoting one.
LABEL = "Part {}: "
SEPARATOR = "\n\n"  # between two labelled summaries


@dataclass
class Progress:
    phase: str  # one of vocabulary.PHASES
    chunks_done: int
    chunks_total: int
    tokens_done: int  # document tokens prefilled
    tokens_total: int
    elapsed_s: float


@dataclass
class Run:
    """Bookkeeping for one document: what the caller is told after each step, and what the run's stats say."""

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


@dataclass(frozen=True)
class SummaryPrompts:
    """How the model is asked for a section's summary and for a combine, where its answer stops, and the longest
    text each prompt leaves room for in the model's context beside an answer of `summary_tokens`."""

    summarize: PromptFrame
    combine: PromptFrame
    stop: list[int]  # the tokens that end an answer
    section_tokens: int  # the longest section summarised on its own
    combine_tokens: int  # the longest input of one combine

    @classmethod
    def fit(cls, loaded: LoadedModel, summary_tokens: int, section_tokens: int) -> SummaryPrompts:
        """`section_tokens` caps the sections; 0: as long as the context allows."""
        tokenizer = loaded.tokenizer
        stop = stop_ids(loaded.model, tokenizer)
        if not stop:
            raise ValueError(f"{loaded.name}: neither the model nor the tokenizer names an end-of-sequence token")
        summarize, combine = PromptFrame.build(tokenizer, SUMMARIZE), PromptFrame.build(tokenizer, COMBINE)
        spacing = len(text_tokens(tokenizer, SEPARATOR)) + len(text_tokens(tokenizer, LABEL.format(999)))
        context, n = loaded.context_tokens, summary_tokens
        fits = context - summarize.overhead - n
        sections = min(fits, section_tokens) if section_tokens else fits
        combined = context - combine.overhead - n
        # Each reduce round must at least halve the summaries, or a long document would never finish.
        if combined < 2 * (n + spacing) or sections < 1:
            raise ValueError(f"summary_tokens={n} is too large for {loaded.name}'s context of {context} tokens "
                             f"(at most {(context - combine.overhead - 2 * spacing) // 3})")
        return cls(summarize, combine, stop, sections, combined)


class Summarizer:
    """Map then reduce over a document's sections, decoding in the run's runtime."""

    def __init__(self, loaded: LoadedModel, runtime: MoeRuntime, prompts: SummaryPrompts, embedder: Embedder, *,
                 chunk_tokens: int, summary_tokens: int) -> None:
        self.loaded = loaded
        self.runtime = runtime
        self.prompts = prompts
        self.embedder = embedder
        self.chunk_tokens = chunk_tokens
        self.summary_tokens = summary_tokens
        self._separator = text_tokens(loaded.tokenizer, SEPARATOR)

    def map(self, sections: list[Sequence[int]], run: Run,
            pooling: str) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
        """Prefill each section after the prompt prefix, pooling the document tokens of every chunk, then
        decode the section's summary from the cache. The prefix shares the first chunk, so no step is
        a mostly empty launch.

        Returns (n_chunks, H) pooled final hidden states per chunk, (n_chunks,) document tokens per chunk,
        and each section's summary tokens."""
        prefix = len(self.prompts.summarize.prefix)  # the embedder puts the prefix before each section
        chunks_total = sum(math.ceil((prefix + len(section)) / self.chunk_tokens) for section in sections)
        chunks_done = 0
        vectors: list[torch.Tensor] = []
        sizes: list[int] = []
        summaries: list[list[int]] = []
        for section in sections:
            tick = time.perf_counter()
            cache = self._cache_for(self.prompts.summarize, section)
            for chunk in self.embedder.chunks(section, cache, pooling):
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

    def reduce(self, summaries: list[list[int]], run: Run) -> tuple[str, int]:
        """Combine the section summaries, as many at a time as fit the context, until one is left; (the document's
        summary as a reader gets it, the rounds it took). After more than one section, the summary ends with an
        outline: what each part that went into the last combine is about."""
        tick = time.perf_counter()
        rounds = 0
        combined = summaries
        while len(summaries) > 1:
            rounds += 1
            combined = summaries
            labelled = [[*self._label(i), *summary] for i, summary in enumerate(summaries, 1)]
            joined = [*labelled[0], *(t for s in labelled[1:] for t in (*self._separator, *s))]
            parts = windows(joined, self.prompts.combine_tokens)
            summaries = []
            for part in parts:
                cache = self._cache_for(self.prompts.combine, part)
                self._prefill([*self.prompts.combine.prefix, *part], cache)
                summaries.append(self._decode(self.prompts.combine, part, cache, run))
                run.report(REDUCE, len(summaries), len(parts))
        run.seconds[REDUCE] = time.perf_counter() - tick
        said = finished_sentences(self._written(summaries[0]))
        if rounds:
            said += "\n\n" + outline([self._written(part) for part in combined])
        return said, rounds

    def _section_summary(self, section: Sequence[int], cache: Any, run: Run) -> list[int]:
        """The section's summary decoded from `cache`; an answer that only says the instruction back gives way to the
        section's own opening sentences, which say more of what it is about to a reader and to the combine."""
        said = self._decode(self.prompts.summarize, section, cache, run)
        if not echoes(self.loaded.tokenizer.decode(said, skip_special_tokens=True), SUMMARIZE):
            return said
        text = from_first_sentence(self._written(section))  # a section may start mid-sentence
        return text_tokens(self.loaded.tokenizer, opening(text, OUTLINE_WORDS))

    def _decode(self, frame: PromptFrame, text: Sequence[int], cache: Any, run: Run) -> list[int]:
        with self.runtime.decoding():
            said = decode_from_cache(self.loaded.model, [*frame.prefix, *text, *frame.suffix], cache,
                                     answer_tokens(len(text), self.summary_tokens), self.prompts.stop)
        run.generated_tokens += len(said)
        return without_thinking(self.loaded.tokenizer, said)  # reasoning never reaches a summary or a combine

    def _cache_for(self, frame: PromptFrame, text: Sequence[int]) -> Any:
        """A cache made once for the prompt around `text` and its answer, written in place as they run."""
        return new_cache(self.loaded.model, capacity=frame.overhead + len(text) + self.summary_tokens)

    def _prefill(self, ids: Sequence[int], cache: Any) -> None:
        """Prefill without looking at the output (a combine's prompt and parts)."""
        for _ in prefill(self.loaded.model, ids, self.chunk_tokens, cache):
            pass

    def _label(self, i: int) -> list[int]:
        return text_tokens(self.loaded.tokenizer, LABEL.format(i))

    def _written(self, ids: Sequence[int]) -> str:
        """Tokens as text, the hard-wrapped lines inside its paragraphs joined."""
        return joined_lines(self.loaded.tokenizer.decode(ids, skip_special_tokens=True))
