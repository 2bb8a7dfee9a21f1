"""llama.cpp's rows beside the engine's in `bench prefill`, on the same weights.

The bench's own model (the random-weight checkpoint the engine and transformers rows run) is written to GGUF in the
run's float dtype (f32 or bf16: the same numbers), then requantized to Q8_0 and Q4_0 by llama-quantize as a person
would (its own choice of type per tensor, recorded in each row); llama-bench then prefills the same number of
tokens in the same chunks on the same threads. llama-bench feeds its own random tokens and prints no output, so its
rows compute the same model on other tokens and are not checked ("unchecked"). It runs after the in-process rounds,
in a process of its own: its ratios to the other rows are of medians taken apart, and their ranges unpaired.
"""

from __future__ import annotations

import statistics
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import gguf
import torch
from transformers import PreTrainedModel

from npumoe.engine.synthetic.gguf_writer import write_model_gguf

from ..fair.paired import add_ratios, best_engine_row
from .llama_cpp import NO_REPACK, LlamaCpp, ToolCrashed, bench_command, quantize, run_bench

PEER = "llama.cpp"
Q = gguf.GGMLQuantizationType
FLOAT_TYPES = {torch.float32: ("f32", Q.F32), torch.bfloat16: ("bf16", Q.BF16)}  # the run's dtype, exactly
QUANTIZED_TYPES = ("Q8_0", "Q4_0")  # llama-quantize's names
NOTE = "llama.cpp: same weights, its own random tokens; not checked"
# Why a row ran without repacked weights: on Sapphire Rapids, llama.cpp's AMX layout of Q8_0 and Q4_0 weights
# crashes in its matmul (ggml-org/llama.cpp#20824, open), so the run is repeated the way it does run.
UNREPACKED = "llama-bench crashed with its repacked weights (AMX: llama.cpp#20824); rerun with --repack 0"
# What each row keeps of llama-bench's JSON: its build, the settings it ran with, its own mean and spread.
KEPT = ("build_commit", "build_number", "cpu_info", "backends", "model_type", "model_size", "model_n_params",
        "n_batch", "n_ubatch", "n_threads", "type_k", "type_v", "flash_attn", "use_mmap", "poll", "n_prompt", "n_gen",
        "avg_ts", "stddev_ts", "avg_ns", "stddev_ns")


def peer_rows(tool: LlamaCpp, model: PreTrainedModel, case: dict, rows: list[dict], *, warmup: int,
              repeats: int) -> list[dict]:
    """`rows` (one case's, timed) and llama.cpp's rows for the same case after them, every row's ratios updated."""
    with tempfile.TemporaryDirectory(prefix="npumoed-peer-") as scratch:
        try:
            files = export(tool, model, Path(scratch), threads=case["threads"])
        except Exception as e:  # a benchmark reports the peer that could not be made; it does not stop on it
            return with_ratios([*rows, {"impl": PEER, "status": "skipped", "error": f"{type(e).__name__}: {e}"}])
        peer = [_timed(tool, f"{PEER}-{name}", file, case, warmup=warmup, repeats=repeats)
                for name, file in files.items()]
    return with_ratios([*rows, *peer])


def export(tool: LlamaCpp, model: PreTrainedModel, folder: Path, *, threads: int) -> dict[str, Path]:
    """The model as GGUF files in `folder`, by format name: its own dtype's, then each of QUANTIZED_TYPES."""
    if model.dtype not in FLOAT_TYPES:
        raise ValueError(f"llama.cpp's peer rows need an f32 or bf16 model, got {model.dtype}")
    name, qtype = FLOAT_TYPES[model.dtype]
    files = {name: write_model_gguf(model, None, folder / f"model-{name}.gguf", experts=qtype, weights=qtype)}
    for type_name in QUANTIZED_TYPES:
        files[type_name.lower()] = quantize(tool, files[name], folder / f"model-{type_name.lower()}.gguf", type_name,
                                            threads=threads)
    return files


def with_ratios(rows: list[dict]) -> list[dict]:
    """Ratios to transformers' best for every row, and each peer row's to the engine's best exact path: of the
    medians, and the unpaired range (its slowest run against the engine's fastest round, and the other way)."""
    rows = add_ratios(rows)
    best = best_engine_row(rows)
    if best is None:
        return rows
    engine = [1 / s for s in best["round_seconds"]]
    for row in rows:
        if row["impl"].startswith(f"{PEER}-") and "tokens_per_s" in row:
            peer = [1 / s for s in row["sample_seconds"]]
            row["vs_engine_best"] = row["tokens_per_s"] / best["tokens_per_s"]
            row["vs_engine_best_range"] = [min(peer) / max(engine), max(peer) / min(engine)]
            row["engine_best"] = best["impl"]
    return rows


def peer_lines(rows: Sequence[dict]) -> list[str]:
    """One line per timed peer row: its speed over the engine's best exact path, and the range."""
    lines = []
    for row in rows:
        if "vs_engine_best" in row:
            low, high = row["vs_engine_best_range"]
            lines.append(f"  {row['impl']}: {row['vs_engine_best']:.2f}× the engine's best exact path "
                         f"{row['engine_best']} ({low:.2f}-{high:.2f} unpaired: run by run against round by round; "
                         f"GGUF types {_types(row['gguf_types'])})"
                         + (f"; {row['fallback']}" if "fallback" in row else ""))
    return lines


def _timed(tool: LlamaCpp, impl: str, file: Path, case: dict, *, warmup: int, repeats: int) -> dict:
    tokens = case["document_tokens"]
    command = bench_command(tool, file, tokens=tokens, chunk=case["chunk_tokens"], threads=case["threads"],
                            warmup=warmup, repeats=repeats)
    base = {"impl": impl, "gguf_types": dict(Counter(t.tensor_type.name for t in gguf.GGUFReader(file).tensors)),
            "gguf_bytes": file.stat().st_size, "llama_bench_args": [file.name if a == str(file) else a
                                                                    for a in command[1:]]}
    note = NOTE
    try:
        try:
            result = run_bench(command, tokens=tokens)
        except ToolCrashed as e:
            command = [*command, *NO_REPACK]
            base |= {"llama_bench_args": [*base["llama_bench_args"], *NO_REPACK], "crash": str(e)}
            note = f"{NOTE}; not repacked"
            result = run_bench(command, tokens=tokens)
            base["fallback"] = UNREPACKED
    except Exception as e:  # reported in its row, as a transformers implementation that cannot run is
        return {**base, "status": "skipped", "error": f"{type(e).__name__}: {e}"}
    samples = [ns / 1e9 for ns in result["samples_ns"]]
    seconds = statistics.median(samples)
    return {**base, "status": "unchecked", "note": note, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "sample_seconds": samples, "llama_bench": {key: result[key] for key in KEPT if key in result}}


def _types(counts: dict[str, int]) -> str:
    return ", ".join(f"{count} {name}" for name, count in sorted(counts.items(), key=lambda item: -item[1]))
