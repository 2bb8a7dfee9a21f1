"""The engine's perplexity on a GGUF file beside llama.cpp's `llama-perplexity` on the same file and the same tokens.

llama-perplexity cuts the tokenized text into chunks of `context` tokens, runs each from an empty cache (a BOS in
place of its first token where the model's vocabulary asks for one) and scores the second half of each chunk: the
logits at positions context/2 … context−2, each against the token after it. The engine's figure is computed the same
way here, on the tokens llama-perplexity itself evaluated (read back from the file it saves them to), so neither
tokenizer nor chunking differs: what is left is the weights as each engine reads the file, and its arithmetic.

The engine loads the file as the daemon does (`weights = "auto"` unless told, every expert packed on the CPU), in
this process after llama-perplexity has finished; its load time and the process's peak resident memory are
recorded beside llama.cpp's own.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from npumoe.engine.formats.gguf_blocks import CONVERSIONS, SECONDS, conversions_since
from npumoe.engine.vocabulary import AUTO

from ..memory import peak_rss, rss
from ..peer.llama_cpp import (
    LlamaCpp,
    parse_perplexity,
    perplexity_command,
    perplexity_tool,
    read_evaluated_tokens,
    run_perplexity,
)


@dataclass(frozen=True)
class PeerFidelitySettings:
    context: int = 512  # llama-perplexity's -c: tokens a chunk
    chunk_tokens: int = 128  # the engine's prefill chunk within each
    threads: int = 2
    weights: str = AUTO


def chunked_perplexity(logits_of: Callable[[list[int]], torch.Tensor], tokens: Sequence[int], context: int,
                       bos: int | None) -> tuple[float, int]:
    """(perplexity, scored tokens) as llama-perplexity computes it: whole chunks of `context` tokens, each run on
    its own with `bos` in place of its first token (None: left as it is), the second half of each scored."""
    first = context // 2
    nll, scored = 0.0, 0
    for start in range(0, len(tokens) - context + 1, context):
        chunk = list(tokens[start:start + context])
        if bos is not None:
            chunk[0] = bos
        logits = logits_of(chunk)
        targets = torch.tensor(tokens[start + first + 1:start + context])
        nll += float(F.cross_entropy(logits[first:context - 1].double(), targets, reduction="sum"))
        scored += len(targets)
    if not scored:
        raise ValueError(f"{len(tokens)} tokens make no whole chunk of {context}")
    return math.exp(nll / scored), scored


def gguf_bos(model: Path) -> int | None:
    """The BOS token llama.cpp puts at the start of each chunk for this file: its `tokenizer.ggml.bos_token_id`
    where `tokenizer.ggml.add_bos_token` is true (llama.cpp's default without the key is false for a BPE
    vocabulary, which is all this bench meets; a file that does not say is read as not adding one)."""
    import gguf

    fields = gguf.GGUFReader(model).fields

    def value(key: str) -> object | None:
        field = fields.get(key)
        return None if field is None else field.parts[field.data[0]][0]

    return int(value("tokenizer.ggml.bos_token_id")) if value("tokenizer.ggml.add_bos_token") else None


def run_peer_fidelity(model: Path, tool: LlamaCpp, text: str, settings: PeerFidelitySettings,
                      on_progress: Callable[[str], None] | None = None) -> dict:
    """llama-perplexity on `text`, then the engine on the tokens it evaluated; one row with both figures."""
    from npumoe.engine import Engine, EngineSettings

    path = perplexity_tool(tool)
    if path is None:
        raise ValueError(f"no llama-perplexity beside {tool.bench}; build it with bench/peer/build-llama-cpp.sh")
    say = on_progress or (lambda _: None)
    with tempfile.TemporaryDirectory(prefix="npumoe-peer-fidelity-") as scratch:
        text_file, tokens_file = Path(scratch) / "text.txt", Path(scratch) / "evaluated.bin"
        text_file.write_text(text)
        command = perplexity_command(path, model, text_file, context=settings.context, threads=settings.threads,
                                     tokens_file=tokens_file)
        say(f"llama-perplexity: {' '.join(command)}")
        ran = run_perplexity(command)
        peer = parse_perplexity(ran.stdout + ran.stderr)
        context, tokens = read_evaluated_tokens(tokens_file)
    if context != settings.context or len(tokens) != peer.chunks * context:
        raise RuntimeError(f"llama-perplexity evaluated {len(tokens)} tokens in chunks of {context}, not "
                           f"{peer.chunks} of {settings.context}")
    say(f"llama.cpp: perplexity {peer.perplexity:.4f} ± {peer.error:.4f} over {peer.chunks} chunks")
    counts, spent = CONVERSIONS.copy(), SECONDS.copy()
    before, started = rss(), time.perf_counter()
    engine = Engine.load(EngineSettings(model=str(model), weights=settings.weights,
                                        chunk_tokens=settings.chunk_tokens, threads=settings.threads))
    load_s, load_peak = time.perf_counter() - started, peak_rss()
    conversions = conversions_since(counts, spent)  # what of the load went into reading each block type
    bos = gguf_bos(model)
    started = time.perf_counter()
    perplexity, scored = chunked_perplexity(engine.logits, tokens, context, bos)
    seconds = time.perf_counter() - started
    engine.close()
    say(f"engine ({engine.settings.weights}): perplexity {perplexity:.4f}")
    return {"model": str(model), "text_tokens": len(tokens), "context": context, "chunks": peer.chunks,
            "scored_tokens": scored, "bos": bos, "weights": engine.settings.weights,
            "engine_perplexity": perplexity, "llama_cpp_perplexity": peer.perplexity,
            "llama_cpp_perplexity_error": peer.error, "ratio": perplexity / peer.perplexity,
            "engine_load_s": load_s, "engine_conversions": conversions, "engine_rss_before_load": before,
            "engine_load_peak_rss": load_peak, "engine_peak_rss": peak_rss(), "engine_eval_s": seconds,
            "llama_cpp_load_s": peer.load_s, "llama_cpp_peak_rss": ran.peak_rss, "llama_cpp_command": command[1:]}
