"""Search vectors of a text, made by the summary's own prefill.

A text is cut into the summary's sections and each section is prefilled after the summary prompt's prefix,
chunk by chunk; each chunk's text tokens are pooled as `pooling` says (pooling.py) into one vector, and the
text's vector is the token-weighted mean of its chunks'. Every vector is L2-normalised. A document's chunk
vectors come out of the prefill its summary needs anyway (the summarizer pools through `Embedder.chunks`); a
search query takes the same path without decoding, so queries and chunks share one space.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from ..attach.runtime import MoeRuntime
from ..loading.load import LoadedModel
from ..moe.dispatch import DispatchStats
from ..vocabulary import PROMPT
from .pooling import OneWordFrame, check_pooling, pooled
from .prefill import new_cache, prefill, windows


class Embedder:
    """Chunk vectors and character spans of a text; `prefix` is the summary prompt's tokens before the text."""

    def __init__(self, loaded: LoadedModel, runtime: MoeRuntime, prefix: Sequence[int], *, chunk_tokens: int,
                 section_tokens: int) -> None:
        self.loaded = loaded
        self.runtime = runtime
        self.prefix = list(prefix)
        self.chunk_tokens = chunk_tokens
        self.section_tokens = section_tokens
        self.one_word = OneWordFrame.build(loaded.tokenizer)
        # The dispatch counts of the last text embedded, kept apart from those of a document being processed: the
        # daemon embeds a search query between a document's chunks.
        self.stats = DispatchStats()

    def embed(self, text: str, pooling: str) -> np.ndarray:
        """(H,) float32 vector of a text, such as a search query, made exactly as a document's vector is."""
        vectors, sizes = self._vectors(self.encode(text)["input_ids"], pooling)
        return rows(vectors, sizes)[-1]

    def embed_document(self, text: str, pooling: str) -> tuple[np.ndarray, np.ndarray]:
        """(embeddings, spans) of a document as `Engine.process` makes them, without its summary."""
        encoded = self.encode(text)
        vectors, sizes = self._vectors(encoded["input_ids"], pooling)
        return rows(vectors, sizes), self.spans(encoded, sizes)

    def encode(self, text: str) -> Any:
        """The tokenizer's encoding of `text`: its ids, and each token's characters where the tokenizer says them.
        An empty text, or one of whitespace only, is refused: it has nothing to summarise or embed."""
        if not text.strip():
            raise ValueError("the text is empty or whitespace only: nothing to summarise or embed")
        tokenizer = self.loaded.tokenizer
        return tokenizer(text, add_special_tokens=False, return_offsets_mapping=tokenizer.is_fast)

    def chunks(self, section: Sequence[int], cache: Any, pooling: str) -> Iterator[tuple[torch.Tensor, int] | None]:
        """Prefill the prefix then `section` into `cache`, one chunk at a time; for each chunk yield the vector (H,)
        pooled from its section tokens and their count, or None when the chunk holds only prefix tokens."""
        position = 0  # in the prefilled stream: prefix, then section
        for hidden in prefill(self.loaded.model, [*self.prefix, *section], self.chunk_tokens, cache):  # (n, H)
            tokens = hidden[max(0, len(self.prefix) - position):]  # this chunk's section tokens
            position += hidden.shape[0]
            yield (pooled(tokens, pooling), len(tokens)) if len(tokens) else None

    def one_word_vectors(self, ids: Sequence[int], sizes: torch.Tensor) -> torch.Tensor:
        """(n_chunks, H) PromptEOL vectors: each chunk of `ids` (`sizes` tokens each, in order) alone in the
        one-word prompt, prefilled from an empty cache, the prompt's last hidden state."""
        ends = np.cumsum(sizes.int().tolist())
        vectors = []
        for start, end in zip([0, *ends[:-1]], ends, strict=True):
            *_, hidden = prefill(self.loaded.model, self.one_word.around(ids[start:end]), self.chunk_tokens,
                                 new_cache(self.loaded.model))
            vectors.append(pooled(hidden, PROMPT))
        return torch.stack(vectors)

    def spans(self, encoded: Any, sizes: torch.Tensor) -> np.ndarray:
        """(n_chunks, 2) each chunk's [start, end) characters in the text."""
        token_ends = np.cumsum(sizes.cpu().numpy().astype(np.int64))  # chunks follow each other in the text
        if self.loaded.tokenizer.is_fast:
            return _offset_spans(encoded["offset_mapping"], token_ends)
        return _decoded_spans(self.loaded.tokenizer, encoded["input_ids"], token_ends)

    def _vectors(self, ids: Sequence[int], pooling: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(n_chunks, H) chunk vectors and (n_chunks,) their token counts, by the summary's prefill (its prompt
        prefix, its sections and chunks) without decoding."""
        check_pooling(pooling)
        self.stats = DispatchStats()
        with self.runtime.counting(self.stats):
            sections = windows(ids, self.section_tokens)
            if pooling == PROMPT:
                sizes = self._chunk_sizes(sections)
                return self.one_word_vectors(ids, sizes), sizes
            chunks = [chunk for section in sections
                      for chunk in self.chunks(section, new_cache(self.loaded.model), pooling) if chunk]
        vectors = torch.stack([vector for vector, _ in chunks])
        return vectors, torch.tensor([size for _, size in chunks], dtype=torch.float32, device=vectors.device)

    def _chunk_sizes(self, sections: list[Sequence[int]]) -> torch.Tensor:
        """(n_chunks,) text tokens in each prefill chunk, cut as `chunks` cuts them, without prefilling."""
        prefix, step = len(self.prefix), self.chunk_tokens
        sizes = [min(start + step, prefix + len(s)) - max(start, prefix)
                 for s in sections for start in range(0, prefix + len(s), step)]
        return torch.tensor([n for n in sizes if n > 0], dtype=torch.float32)


def rows(vectors: torch.Tensor, sizes: torch.Tensor) -> np.ndarray:
    """(n + 1, H) float32: the chunk vectors (n, H) and their token-weighted mean, each L2-normalised."""
    mean = (vectors * sizes[:, None]).sum(0) / sizes.sum()  # (H,) over every token, from the per-chunk ones
    return torch.nn.functional.normalize(torch.cat([vectors, mean[None]]), dim=-1).cpu().numpy()


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
