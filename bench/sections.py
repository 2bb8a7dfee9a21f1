"""Section length against throughput and vector drift: what `[model] section_tokens` trades.

A shorter section is prefilled at a shallower attention depth (faster chunks) but each section is
summarised on its own, so there are more summaries to decode and combine, and a chunk no longer attends to
the text before its section, so its vector moves. One checkpoint of a geometry at its real sizes (a few
layers, random weights, the byte tokenizer: one token a byte; bench/memory.py writes it) processes one
document of the sample texts through `Engine.process` at each section length. Each row reports document
tokens/s (the whole call, and prefill alone), the summaries decoded and combined, and how far the vectors
moved against the longest-section run: the cosine of the document vectors, and of each chunk vector with
the reference chunk that holds the same text.

Random weights cannot say how good a summary is, so summaries are compared by count and cost only.
"""

from __future__ import annotations

import gc
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from npumoe.engine.vocabulary import CHUNK_TOKENS, SUMMARY_TOKENS

DOCUMENT_COSINE = 0.99  # a section length is acceptable when the document vector keeps at least this cosine


@dataclass(frozen=True)
class SectionBenchSettings:
    geometry: str = "qwen3-30b-a3b"
    layers: int = 2
    document_tokens: int = 8192
    section_tokens: tuple[int, ...] = (0, 4096, 2048, 1024)  # 0: as long as the context allows (the reference)
    chunk_tokens: int = CHUNK_TOKENS
    summary_tokens: int = SUMMARY_TOKENS
    weights: str = "bf16"
    threads: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.layers, self.document_tokens, self.chunk_tokens, self.summary_tokens, self.threads) < 1:
            raise ValueError(f"every size and count must be positive, got {self}")
        if not self.section_tokens or min(self.section_tokens) < 0:
            raise ValueError(f"section lengths must be 0 (the context) or positive, got {self.section_tokens}")


def sample_text(tokens: int) -> str:
    """`tokens` bytes of the sample documents, repeated as often as needed (the byte tokenizer: a byte a token)."""
    from npumoe.daemon.samples import sample_documents

    corpus = "\n\n".join("\n\n".join(doc.paragraphs) for doc in sample_documents()).encode()
    repeated = corpus * (tokens // len(corpus) + 1)
    return repeated[:tokens].decode(errors="ignore")


def chunk_cosines(rows: np.ndarray, spans: np.ndarray, reference_rows: np.ndarray,
                  reference_spans: np.ndarray) -> np.ndarray:
    """Cosine of each chunk vector with the reference chunk holding its middle character (rows are unit
    vectors, so the cosine is their dot product)."""
    middles = (spans[:, 0] + spans[:, 1]) // 2
    matched = np.searchsorted(reference_spans[:, 1], middles, side="right")
    return np.einsum("ij,ij->i", rows, reference_rows[np.minimum(matched, len(reference_rows) - 1)])


def choose(rows: Sequence[dict], threshold: float = DOCUMENT_COSINE) -> dict:
    """The fastest row (whole-call tokens/s) whose document vector keeps `threshold` cosine with the reference."""
    kept = [row for row in rows if row["document_cosine"] >= threshold]
    return max(kept, key=lambda row: row["tokens_per_s"])


def run_sections_bench(settings: SectionBenchSettings,
                       on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """One row per section length on a checkpoint of `settings.geometry` written for the run."""
    from .memory import write_checkpoint

    with tempfile.TemporaryDirectory(prefix="npumoe-sections-") as temporary:
        folder = write_checkpoint(settings.geometry, settings.layers, Path(temporary) / "model", settings.seed)
        rows = compare_sections(folder, settings, on_result)
    return [{"geometry": settings.geometry, "layers": settings.layers, **row} for row in rows]


def compare_sections(folder: Path, settings: SectionBenchSettings,
                     on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """One row per section length on the checkpoint in `folder`: the longest first (the reference the cosines
    are taken against), then shorter ones; the chosen one marked."""
    import torch

    from npumoe.engine import Engine, EngineSettings

    torch.set_num_threads(settings.threads)
    lengths = sorted(set(settings.section_tokens), key=lambda n: -n if n else -float("inf"))
    text = sample_text(settings.document_tokens)
    rows: list[dict] = []
    reference = None
    for length in lengths:
        engine = Engine.load(EngineSettings(model=str(folder), weights=settings.weights,
                                            chunk_tokens=settings.chunk_tokens,
                                            summary_tokens=settings.summary_tokens, section_tokens=length))
        engine.process(text[:settings.chunk_tokens])  # first-call costs (kernel choice, packing) untimed
        result = engine.process(text)
        length_used = engine.section_tokens
        engine.close()
        del engine  # one model in memory at a time: the next length loads its own
        gc.collect()
        if reference is None:
            reference = result
        stats = result.stats
        cosines = chunk_cosines(result.embeddings[:-1], result.spans, reference.embeddings[:-1], reference.spans)
        row = {"weights": settings.weights, "document_tokens": stats.tokens, "chunk_tokens": stats.chunk_tokens,
               "section_tokens": length, "section_length": length_used, "sections": stats.sections,
               "reduce_rounds": stats.reduce_rounds, "generated_tokens": stats.generated_tokens,
               "seconds": dict(stats.seconds), "tokens_per_s": stats.tokens / stats.seconds["total"],
               "prefill_tokens_per_s": stats.tokens / stats.seconds["prefill"],
               "document_cosine": float(result.embeddings[-1] @ reference.embeddings[-1]),
               "chunk_cosine_mean": float(cosines.mean()), "chunk_cosine_min": float(cosines.min())}
        rows.append(row)
        if on_result is not None:
            on_result(row)
    chosen = choose(rows)
    for row in rows:
        row["chosen"] = row is chosen
        row["speedup"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows
