"""`npumoed bench`: the engine's benchmarks (MoE layer, whole-model prefill, pruning fidelity).

The lead wires it into `npumoed` with `main.add_command(bench)`. torch and transformers are imported
inside the commands, so `npumoed --help` stays fast. Each command prints a table and, with --json,
writes {"machine": ..., "settings": ..., "results": [...]} for the results folder.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.table import Column, Table

from .memory import GGUF_TYPES
from .service.foreground import foreground

if TYPE_CHECKING:
    from npumoe.engine import Engine
    from npumoe.engine.loading.load import LoadedModel

    from .real_fidelity import RealFidelitySettings
from npumoe.engine.vocabulary import (
    AUTO,
    BF16,
    CHUNK_TOKENS,
    DTYPE_ALIASES,
    DTYPES,
    FP32,
    INT4,
    INT8,
    POOLINGS,
    QUANTIZED,
    SUMMARY_TOKENS,
    WEIGHTS_DTYPE,
    dtype_name,
)

# The tiny families `bench fidelity` compares weights formats on by default.
FIDELITY_FAMILIES = ("qwen3_moe", "olmoe", "mixtral")

# Every spelling of a dtype the options take; what reaches the benchmarks and their results is the vocabulary's own.
# auto: the float dtype `weights = auto` runs each geometry's experts in here (the fastest measured).
DTYPE_SPELLINGS = (AUTO, *DTYPES, *DTYPE_ALIASES)

_err = Console(stderr=True)

MIN_SECONDS = 30.0  # the timed rounds of a case add up to at least this by default (bench moe, bench prefill)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def bench() -> None:
    """Benchmarks: print a table, optionally write JSON with the machine description."""


bench.add_command(foreground)


def _threads_option(f):
    return click.option("--threads", type=click.IntRange(min=1), default=os.cpu_count(), show_default=True,
                        help="torch threads (default: all cores).")(f)


def _timing_options(f):
    f = click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True,
                     help="Timed runs per implementation; the median is reported.")(f)
    f = click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True,
                     help="Untimed runs before timing.")(f)
    return click.option("--seed", type=int, default=0, show_default=True, help="Seed for weights and inputs.")(f)


def _rounds_options(f):
    f = click.option("--min-seconds", type=click.FloatRange(min=0), default=MIN_SECONDS, show_default=True,
                     help="Time more rounds than --repeats (up to 50) until the timed ones add up to this: a short "
                          "case gets the rounds its ratio ranges need.")(f)
    return click.option("--own-process/--no-own-process", default=True, show_default=True,
                        help="Also time transformers in a Python process of its own, under torch's OpenMP defaults "
                             "(no OMP_WAIT_POLICY, none of npumoed's settings), in the same rounds.")(f)


def _dtype_option(help_text: str):
    return click.option("--dtype", "dtypes", multiple=True, type=click.Choice(DTYPE_SPELLINGS), default=(AUTO,),
                        show_default=True, help=help_text + " auto: the fastest float dtype measured here.",
                        callback=lambda _ctx, _param, values: tuple(dtype_name(v) for v in values))


def _json_option(f):
    return click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
                        help="Also write the machine description and every result row to this JSON file.")(f)


@bench.command("moe")
@click.option("--geometry", "geometries", multiple=True, default=("qwen3-30b-a3b",), show_default=True,
              help="MoE layer geometry (repeatable): a model named in engine/synthetic/geometries.json (e.g. "
                   "qwen3-30b-a3b, gpt-oss-20b, olmoe-1b-7b), or HIDDENxEXPERTSxTOPKxFFN.")
@click.option("--tokens", multiple=True, type=click.IntRange(min=1), default=(CHUNK_TOKENS,), show_default=True,
              help="Prefill chunk length in tokens (repeatable).")
@_dtype_option("Weight and activation dtype (repeatable).")
@click.option("--skew", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="Zipf exponent of expert popularity in the generated routing (0: uniform).")
@click.option("--calibration-chunks", type=click.IntRange(min=1), default=8, show_default=True,
              help="Routing draws the engine's plan is calibrated on.")
@click.option("--weights", "weights", multiple=True, type=click.Choice(QUANTIZED),
              help="Also run the engine's CPU path with its experts quantized to this format (repeatable); "
                   "approximate rows, timed when within the format's error bound.")
@_threads_option
@_timing_options
@_rounds_options
@_json_option
def moe(geometries: tuple[str, ...], tokens: tuple[int, ...], dtypes: tuple[str, ...], skew: float,
        calibration_chunks: int, weights: tuple[str, ...], threads: int, warmup: int, repeats: int, seed: int,
        min_seconds: float, own_process: bool, json_path: Path | None) -> None:
    """MoE-layer prefill throughput on random weights: transformers' experts vs the engine vs the roofline."""
    parsed = _geometries(geometries)
    dtypes = _measured_dtypes(dtypes, parsed)
    import torch

    from .machine import describe_machine, sampled_load
    from .moe import MoeBenchSettings, run_moe_bench
    from .roofline import MODEL

    torch.set_num_threads(threads)
    machine = describe_machine(threads)
    settings = MoeBenchSettings(threads=threads, warmup=warmup, repeats=repeats, seed=seed, skew=skew,
                                calibration_chunks=calibration_chunks, weights=weights, min_seconds=min_seconds,
                                own_process=own_process)
    with sampled_load(machine):
        results = run_moe_bench(parsed, tokens, dtypes, settings, bandwidth=machine["copy_bandwidth_gbps"] * 1e9,
                                on_result=_progress)
    caption = (f"× transformers: against transformers' fastest implementation in the same case. {MODEL}. "
               f"{threads} threads, copy bandwidth {machine['copy_bandwidth_gbps']} GB/s, {machine['cpu']}; "
               f"routing Zipf skew {skew}.")
    print_results(results, ("geometry", "tokens", "dtype"), caption, machine, baseline="roofline")
    _write_json(json_path, machine, {"warmup": warmup, "repeats": repeats, "min_seconds": min_seconds,
                                     "own_process": own_process, "seed": seed, "skew": skew,
                                     "calibration_chunks": calibration_chunks, "weights": list(weights),
                                     "roofline_model": MODEL}, results)


@bench.command("prefill")
@click.option("--geometry", "geometries", multiple=True, default=("qwen3-30b-a3b",), show_default=True,
              help="Model geometry (repeatable): a name as for `bench moe`, or HIDDENxEXPERTSxTOPKxFFN.")
@click.option("--layers", type=click.IntRange(min=1), default=2, show_default=True,
              help="Decoder layers at the real sizes (the rest of the model is left out).")
@click.option("--document-tokens", type=click.IntRange(min=1), default=2048, show_default=True,
              help="Length of the prefilled document (e.g. 2048, 8192, 16384, 32768: attention grows with depth).")
@click.option("--chunk", "chunk_tokens", type=click.IntRange(min=1), default=CHUNK_TOKENS, show_default=True,
              help="Prefill chunk length; the KV cache carries across chunks.")
@_dtype_option("Model dtype (repeatable).")
@click.option("--calibration-documents", type=click.IntRange(min=1), default=2, show_default=True,
              help="Random documents of the same length the engine's plan is calibrated on.")
@click.option("--weights", "weights", multiple=True, type=click.Choice(QUANTIZED),
              help="Also run the engine's CPU path with its experts (and its dense projections, where that measures "
                   "faster) quantized to this format (repeatable); approximate rows, timed when within the "
                   "format's error bound.")
@click.option("--profile", is_flag=True,
              help="Also split the time of the engine's CPU path (and of each --weights format's) per part "
                   "(experts, attention, projections, norms, router, cache, ...) at several depths, beside each "
                   "part's roofline.")
@click.option("--peer", "peer_dir", type=click.Path(file_okay=False, path_type=Path), envvar="NPUMOE_LLAMA_CPP",
              help="Also run llama.cpp beside them on the same weights: a folder holding llama-bench and "
                   "llama-quantize (or holding them in bin/; bench/peer/build-llama-cpp.sh builds them). "
                   "Default: $NPUMOE_LLAMA_CPP.")
@_threads_option
@_timing_options
@_rounds_options
@_json_option
def prefill(geometries: tuple[str, ...], layers: int, document_tokens: int, chunk_tokens: int,
            dtypes: tuple[str, ...], calibration_documents: int, weights: tuple[str, ...], profile: bool,
            peer_dir: Path | None, threads: int, warmup: int, repeats: int, seed: int, min_seconds: float,
            own_process: bool, json_path: Path | None) -> None:
    """Whole-model document prefill tokens/s on random weights: the engine vs plain transformers (and llama.cpp)."""
    parsed = _geometries(geometries)
    dtypes = _measured_dtypes(dtypes, parsed)
    from functools import partial

    import torch

    from .machine import describe_machine, sampled_load
    from .peer.llama_cpp import find_llama_cpp
    from .peer.prefill_peer import peer_lines, peer_rows
    from .prefill_bench import PrefillBenchSettings, run_prefill_bench

    try:
        peer_tool = find_llama_cpp(peer_dir) if peer_dir is not None else None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--peer") from e

    try:
        settings = PrefillBenchSettings(threads=threads, layers=layers, document_tokens=document_tokens,
                                        chunk_tokens=chunk_tokens, calibration_documents=calibration_documents,
                                        warmup=warmup, repeats=repeats, seed=seed, profile=profile,
                                        weights=weights, min_seconds=min_seconds, own_process=own_process)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    torch.set_num_threads(threads)
    machine = describe_machine(threads)
    peers = [] if peer_tool is None else [partial(peer_rows, peer_tool, warmup=warmup, repeats=repeats)]
    with sampled_load(machine):
        results = run_prefill_bench(parsed, dtypes, settings, bandwidth=machine["copy_bandwidth_gbps"] * 1e9,
                                    peers=peers, on_result=_progress)
    caption = (f"× transformers: against transformers' fastest implementation in the same case. Random weights, "
               f"random-token documents, chunked prefill with the KV cache carried. {threads} threads, "
               f"{machine['cpu']}.")
    case_keys = ("geometry", "layers", "dtype", "document_tokens", "chunk_tokens")
    print_results([row for row in results if row["impl"] != "profile"], case_keys, caption, machine)
    for line in peer_lines(results):
        _console().print(line, highlight=False)
    if profile:
        print_profile([row for row in results if row["impl"] == "profile"], case_keys, machine)
    _write_json(json_path, machine, {"warmup": warmup, "repeats": repeats, "min_seconds": min_seconds,
                                     "own_process": own_process, "seed": seed, "layers": layers,
                                     "calibration_documents": calibration_documents, "weights": list(weights),
                                     "peer": None if peer_tool is None else peer_tool.describe()}, results)


@bench.command("fidelity")
@click.option("--model", "model_name",
              help="demo (the demo MoE) or a checkpoint folder: its weights formats are compared on the sample "
                   "documents (perplexity, top-1, KL against its float weights). Default: a tiny skewed Qwen3-MoE "
                   "made for the run, and the tiny families.")
@click.option("--tokens-per-document", type=click.IntRange(min=2), default=512, show_default=True,
              help="With --model: the first this many tokens of each sample document.")
@click.option("--calibration-text", "calibration_files", multiple=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Text file(s) to calibrate on (default: the sample documents other than the night log).")
@click.option("--eval-text", "eval_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Held-out text file (default: the sample night-shift log).")
@click.option("--scale", "scales", multiple=True, type=click.FloatRange(min=0, min_open=True),
              default=(0.25, 0.5, 0.75, 1.0, 1.5, 2.0), show_default=True,
              help="Capacity scale (repeatable): tiers sized for this multiple of each calibrated p95 load.")
@click.option("--chunk", "chunk_tokens", type=click.IntRange(min=1), default=128, show_default=True,
              help="Prefill chunk length (calibration and evaluation).")
@click.option("--eval-tokens", type=click.IntRange(min=2), default=4096, show_default=True,
              help="At most this many held-out tokens.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the trade-off curves to this PNG (needs the plot extra: matplotlib).")
@click.option("--family", "families", multiple=True, type=click.Choice(FIDELITY_FAMILIES),
              default=FIDELITY_FAMILIES, show_default=True,
              help="Tiny skewed family (repeatable) whose bf16, int8 and int4 runs are compared with fp32 (without "
                   "--model), each with its random output layer and with one fitted to the calibration text.")
@click.option("--layer-geometry", default="qwen3-30b-a3b", show_default=True,
              help="The MoE layer whose int8 and int4 experts' relative error is measured, at these real sizes.")
@click.option("--layer-tokens", type=click.IntRange(min=1), default=CHUNK_TOKENS, show_default=True,
              help="Tokens through that layer.")
@click.option("--capacity/--no-capacity", default=True, show_default=True, help="Run the capacity sweep.")
@click.option("--layer/--no-layer", default=True, show_default=True, help="Measure the real-size layer.")
@_threads_option
@_timing_options
@_json_option
def fidelity(model_name: str | None, tokens_per_document: int, calibration_files: tuple[Path, ...],
             eval_file: Path | None, scales: tuple[float, ...], chunk_tokens: int, eval_tokens: int,
             plot_path: Path | None, families: tuple[str, ...], layer_geometry: str, layer_tokens: int,
             capacity: bool, layer: bool, threads: int, warmup: int, repeats: int, seed: int,
             json_path: Path | None) -> None:
    """Accuracy against capacity (dropped, spilled and padding fractions, top-1 agreement and KL vs the exact
    model), and against the weights' format (bf16, int8, int4 vs fp32, whole model and one real-size layer)."""
    if plot_path is not None:
        _require_matplotlib()
    import tempfile

    import torch

    from npumoe.daemon.cli.model_ref import model_ref
    from npumoe.engine.errors import ModelError
    from npumoe.engine.loading.load import load_model
    from npumoe.engine.synthetic.tiny import make_tiny

    from .fidelity import FidelitySettings, run_fidelity_bench
    from .machine import describe_machine
    from .real_fidelity import RealFidelitySettings

    model_path = Path(model_ref(model_name)) if model_name else None

    calibration_texts, eval_text = _fidelity_texts(calibration_files, eval_file)
    settings = FidelitySettings(threads=threads, scales=tuple(sorted(set(scales))), chunk_tokens=chunk_tokens,
                                eval_tokens=eval_tokens, warmup=warmup, repeats=repeats)
    geometry = _geometries([layer_geometry])[0]
    torch.set_num_threads(threads)
    machine = describe_machine(threads)
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="npumoed-fidelity-") as scratch:
        try:
            loaded = load_model(model_path or make_tiny("qwen3_moe", Path(scratch) / "tiny-qwen3_moe", seed=seed))
            if capacity:
                results = run_fidelity_bench(loaded, calibration_texts, eval_text, settings, on_result=_progress)
            if model_path:
                real_settings = RealFidelitySettings(chunk_tokens=chunk_tokens, tokens_per_document=tokens_per_document)
                weights_rows = _real_fidelity(loaded, model_name, real_settings)
            else:
                weights_rows = _weights_fidelity(families, calibration_texts, eval_text, chunk_tokens, eval_tokens,
                                                 Path(scratch), seed)
        except (ModelError, ValueError) as e:
            raise click.ClickException(str(e)) from e
    from .weights_fidelity import DISTRIBUTIONS, layer_errors

    layer_rows = [row for distribution in (DISTRIBUTIONS if layer else ())
                  for row in layer_errors(geometry, QUANTIZED, distribution, tokens=layer_tokens, seed=seed,
                                          on_result=lambda row: _err.print(
                                              f"{row['geometry']} {row['distribution']} {row['format']}: relative "
                                              f"error {row['rel_error']:.2%}", style="dim", highlight=False))]
    if capacity:
        print_fidelity(results, f"model {loaded.name}, calibrated on "
                                f"{', '.join(name for name, _ in calibration_texts)}, held out: "
                                f"{results[0]['eval_tokens']} tokens, chunk {chunk_tokens}, {threads} threads")
    if model_path:
        print_real_fidelity(weights_rows, f"{loaded.name}: the first {tokens_per_document} tokens of each sample "
                                          f"document ({weights_rows[0]['tokens']} in all), fp32, chunk {chunk_tokens}; "
                                          f"{threads} threads, {machine['cpu']}")
    else:
        print_weights_fidelity(weights_rows, f"held out: {weights_rows[0]['eval_tokens']} tokens; "
                                             f"{threads} threads, {machine['cpu']}")
    if layer_rows:
        print_layer_errors(layer_rows)
    results += [{"section": "real-text" if model_path else "weights", **row} for row in weights_rows]
    results += [{"section": "layer", **row} for row in layer_rows]
    if plot_path is not None and capacity:
        from .plot import fidelity_figure

        plot_path.parent.mkdir(parents=True, exist_ok=True)
        fidelity_figure([row for row in results if "section" not in row]).savefig(plot_path, dpi=120)
        _err.print(f"wrote {plot_path}")
    _write_json(json_path, machine, {"model": loaded.name, "model_key": loaded.key, "seed": seed,
                                     "calibration": [name for name, _ in calibration_texts], "warmup": warmup,
                                     "repeats": repeats}, results)


@bench.command("memory")
@click.option("--geometry", "geometry_name", default="qwen3-30b-a3b", show_default=True,
              help="A model named in engine/synthetic/geometries.json, at its real sizes.")
@click.option("--layers", type=click.IntRange(min=1), default=2, show_default=True,
              help="Decoder layers of the checkpoint written for the run.")
@click.option("--weights", "weights", multiple=True, type=click.Choice(WEIGHTS_DTYPE), default=(BF16, INT8, INT4),
              show_default=True, help="Weights format (repeatable): each is loaded in a process of its own.")
@click.option("--document-tokens", type=click.IntRange(min=1), default=2048, show_default=True,
              help="Tokens of the document processed after loading.")
@click.option("--gguf", "gguf_types", multiple=True, type=click.Choice(GGUF_TYPES),
              help="Also write the checkpoint as a GGUF file in this type (repeatable) and load it in the format "
                   "the type maps to (Q8_0: int8, Q4_x: int4, F16: bf16).")
@click.option("--model", "model_path", type=click.Path(exists=True, path_type=Path),
              help="Measure this checkpoint folder or GGUF file in each --weights format instead of a written one.")
@_threads_option
@_json_option
def memory(geometry_name: str, layers: int, weights: tuple[str, ...], document_tokens: int,
           gguf_types: tuple[str, ...], model_path: Path | None, threads: int, json_path: Path | None) -> None:
    """Peak memory of loading a real-geometry checkpoint (or --model) and processing one document, beside its
    weights' bytes."""
    from .machine import describe_machine
    from .memory import TARGET_RATIO, MemorySettings, run_memory_bench, run_model_memory_bench

    if model_path is not None and gguf_types:
        raise click.UsageError("--gguf writes the bench's own checkpoint as GGUF; it does not go with --model")
    settings = MemorySettings(layers=layers, document_tokens=document_tokens, threads=threads)
    try:
        results = run_model_memory_bench(model_path, list(weights), settings) if model_path else \
            run_memory_bench(geometry_name, list(weights), settings, gguf_types)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    machine = describe_machine(threads)
    gib = 2**30
    measured = model_path or f"{geometry_name}, {layers} layers"
    table = Table("stored", "weights", "kernel", "weights GiB", "experts GiB", "rest GiB", "before GiB", "loaded GiB",
                  "load peak GiB", "peak GiB", "peak − before GiB", "× weights",
                  caption=f"{measured}; load + one {document_tokens}-token document; peak RSS minus the RSS before "
                          f"loading, target ≤ {TARGET_RATIO} × the weights' bytes in the format loaded. {threads} "
                          f"threads, {machine['cpu']}.", caption_justify="left")
    for row in results:
        table.add_row(row["stored"], row["weights"], row["kernel"], *(f"{row[key] / gib:.2f}" for key in (
            "weight_bytes", "expert_bytes", "other_bytes", "before_rss", "loaded_rss", "load_peak_rss", "peak_rss",
            "peak_over_before")), f"{row['ratio']:.2f}")
    _console().print(table)
    _write_json(json_path, machine, {"geometry": geometry_name, "layers": layers, "document_tokens": document_tokens,
                                     "gguf_types": list(gguf_types), "model": str(model_path) if model_path else None},
                results)


def _real_fidelity(loaded: LoadedModel, model_name: str, settings: RealFidelitySettings) -> list[dict]:
    """Each weights format against the model's float weights on the sample documents; for the demo, whose float
    weights come from its GGUF file, the experts' weights are compared with the file's too."""
    from npumoe.daemon.model_choice import DEMO
    from npumoe.daemon.samples import sample_documents
    from npumoe.engine.synthetic.smollm2 import gguf_path

    from .real_fidelity import gguf_dense_ffn, run_real_fidelity

    dense = gguf_dense_ffn(gguf_path(), loaded.model) if model_name == DEMO and gguf_path().is_file() else None
    texts = ["\n\n".join(doc.paragraphs) for doc in sample_documents()]
    return [{"model": model_name, **row} for row in run_real_fidelity(
        loaded, texts, settings, dense=dense, on_result=lambda row: _err.print(
            f"{row['variant']}: perplexity {row['perplexity']:.3f}, top-1 {row['top1_agreement']:.1%}",
            style="dim", highlight=False))]


def _weights_fidelity(families: Sequence[str], calibration_texts: Sequence[tuple[str, str]], eval_text: str,
                      chunk_tokens: int, eval_tokens: int, scratch: Path, seed: int) -> list[dict]:
    """bf16, int8 and int4 against fp32 on each tiny family, with its random output layer and with a readout
    fitted to the calibration texts (so that its top-1 means something)."""
    from npumoe.engine.loading.load import load_model
    from npumoe.engine.synthetic.tiny import make_tiny

    from .weights_fidelity import WeightsFidelitySettings, fit_readout, run_weights_fidelity

    settings = WeightsFidelitySettings(chunk_tokens=chunk_tokens, eval_tokens=eval_tokens)
    rows = []
    for family in families:
        loaded = load_model(make_tiny(family, scratch / f"weights-{family}", seed=seed))
        for head in ("random", "readout"):
            extra = {}
            if head == "readout":
                extra["readout_cross_entropy"] = fit_readout(loaded, [text for _, text in calibration_texts],
                                                             chunk_tokens)
            for row in run_weights_fidelity(loaded, eval_text, settings):
                rows.append({"model": f"tiny {family}", "head": head, **extra, **row})
                _err.print(f"tiny {family}, {head} output layer, {row['format']}: top-1 vs fp32 "
                           f"{row['top1_vs_fp32']:.1%}", style="dim", highlight=False)
    return rows


def print_real_fidelity(rows: Sequence[dict], caption: str) -> None:
    from .real_fidelity import TARGETS

    table = Table("weights", "perplexity", "Δ perplexity", "top-1 vs float", "mean KL vs float", "target",
                  "expert weights' error", "vs the GGUF's", "what it means",
                  title="Weights format against the float model, on real text", caption=caption,
                  caption_justify="left")
    for row in rows:
        target = TARGETS.get(row["format"])
        table.add_row(row["variant"], f"{row['perplexity']:.3f}", f"{row['perplexity_change']:+.2%}",
                      _percent(row["top1_agreement"]), _error(row["mean_kl"]),
                      f"top-1 ≥ {target['top1']:.0%}, Δ ≤ {target['perplexity']:.0%}" if target else "",
                      f"{row['weight_error']:.2%}", _percent(row.get("weight_error_vs_gguf")), row["meaning"])
    _console().print(table)


def print_weights_fidelity(rows: Sequence[dict], caption: str) -> None:
    table = Table("model", "output layer", "weights", "top-1 vs fp32", "mean KL vs fp32", "top-1 vs its float",
                  "mean KL vs its float", title="Weights format against the float model", caption=caption,
                  caption_justify="left")
    for row in rows:
        table.add_row(row["model"], row["head"], row["format"], _percent(row["top1_vs_fp32"]),
                      _error(row["kl_vs_fp32"]), f"{_percent(row['top1_vs_float'])} ({row['vs_float']})",
                      _error(row["kl_vs_float"]))
    _console().print(table)


def print_layer_errors(layer_rows: Sequence[dict]) -> None:
    from .weights_fidelity import TARGETS

    layers = Table("geometry", "weights and activations", "format", "relative error", "weights alone", "target",
                   title="One MoE layer, quantized experts against fp32",
                   caption="weights alone: the format's floor, its rounded weights with exact fp32 activations",
                   caption_justify="left")
    for row in layer_rows:
        layers.add_row(row["geometry"], row["distribution"], row["format"], f"{row['rel_error']:.2%}",
                       f"{row['weights_alone_error']:.2%}", f"≤ {TARGETS[row['format']]:.0%}")
    _console().print(layers)


@bench.command("sections")
@click.option("--geometry", "geometry_name", default="qwen3-30b-a3b", show_default=True,
              help="A model named in engine/synthetic/geometries.json, at its real sizes.")
@click.option("--layers", type=click.IntRange(min=1), default=2, show_default=True,
              help="Decoder layers of the checkpoint written for the run.")
@click.option("--document-tokens", type=click.IntRange(min=1), default=8192, show_default=True,
              help="Length of the document (sample texts; one token a byte).")
@click.option("--section", "sections", multiple=True, type=click.IntRange(min=0), default=(0, 4096, 2048, 1024),
              show_default=True, help="Section length (repeatable); 0: as long as the context allows, the reference.")
@click.option("--chunk", "chunk_tokens", type=click.IntRange(min=1), default=CHUNK_TOKENS, show_default=True,
              help="Prefill chunk length.")
@click.option("--summary-tokens", type=click.IntRange(min=1), default=SUMMARY_TOKENS, show_default=True,
              help="Most tokens each summary and combine may write ([model] summary_tokens).")
@click.option("--weights", type=click.Choice((FP32, BF16)), default=BF16, show_default=True,
              help="Weights format of the run.")
@_threads_option
@_json_option
def sections(geometry_name: str, layers: int, document_tokens: int, sections: tuple[int, ...], chunk_tokens: int,
             summary_tokens: int, weights: str, threads: int, json_path: Path | None) -> None:
    """Section length against throughput and how far the vectors move: the trade [model] section_tokens makes."""
    from .machine import describe_machine
    from .sections import DOCUMENT_COSINE, SectionBenchSettings, run_sections_bench

    try:
        settings = SectionBenchSettings(geometry=geometry_name, layers=layers, document_tokens=document_tokens,
                                        section_tokens=sections, chunk_tokens=chunk_tokens,
                                        summary_tokens=summary_tokens, weights=weights, threads=threads)
        results = run_sections_bench(settings, on_result=lambda row: _err.print(
            f"section {row['section_tokens']}: {row['tokens_per_s']:,.1f} tokens/s, {row['sections']} sections, "
            f"document cosine {row['document_cosine']:.4f}", style="dim", highlight=False))
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    machine = describe_machine(threads)
    table = Table("section tokens", "sections", "reduce rounds", "generated", "prefill s", "summary s", "reduce s",
                  "total s", "prefill tok/s", "tok/s", "× longest", "document cos", "chunk cos mean", "chunk cos min",
                  caption=f"{geometry_name}, {layers} layers, {weights}, random weights; one {document_tokens}-token "
                          f"document, chunk {chunk_tokens}, summaries of at most {summary_tokens} tokens. Cosines "
                          f"against the first row (the longest sections). * the fastest whose document vector keeps "
                          f"cosine ≥ {DOCUMENT_COSINE}. {threads} threads, {machine['cpu']}.",
                  caption_justify="left")
    for row in results:
        seconds = row["seconds"]
        length = f"{row['section_tokens'] or 'context'} ({row['section_length']})"
        table.add_row(f"{length}{' *' if row['chosen'] else ''}", str(row["sections"]), str(row["reduce_rounds"]),
                      str(row["generated_tokens"]), *(f"{seconds[key]:.1f}" for key in ("prefill", "summary",
                                                                                        "reduce", "total")),
                      _number(row["prefill_tokens_per_s"]), _number(row["tokens_per_s"]), _ratio(row["speedup"]),
                      f"{row['document_cosine']:.4f}", f"{row['chunk_cosine_mean']:.4f}",
                      f"{row['chunk_cosine_min']:.4f}")
    _console().print(table)
    _write_json(json_path, machine, settings.__dict__, results)


def _geometries(names: Sequence[str]) -> list:
    from npumoe.engine.synthetic.geometry import parse_geometry

    try:
        return [parse_geometry(name) for name in names]
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--geometry") from e


def _measured_dtypes(dtypes: Sequence[str], geometries: Sequence) -> tuple[str, ...]:
    """`dtypes` with auto replaced by the float dtype `weights = auto` runs each geometry's experts in here (measured
    once per machine, as at load), each dtype once."""
    if AUTO not in dtypes:
        return tuple(dtypes)
    from npumoe.engine.loading.auto_weights import float_seconds

    fastest = []
    for geometry in geometries:
        seconds = float_seconds(geometry.hidden, geometry.ffn)
        fastest.append(WEIGHTS_DTYPE[min(seconds, key=seconds.__getitem__)])
    return tuple(dict.fromkeys(d for dtype in dtypes for d in (fastest if dtype == AUTO else [dtype])))


def _require_matplotlib() -> None:
    """--plot draws with matplotlib, an optional extra: say so before a run of minutes, not after it."""
    if importlib.util.find_spec("matplotlib") is None:
        raise click.ClickException("--plot needs matplotlib, which is not installed: pip install 'npumoed[plot]'")


def _fidelity_texts(calibration_files: Sequence[Path],
                    eval_file: Path | None) -> tuple[list[tuple[str, str]], str]:
    """(calibration texts as (name, text), held-out text): the files given, else the sample documents."""
    from npumoe.daemon.samples import sample_documents

    samples = {doc.filename: "\n\n".join(doc.paragraphs) for doc in sample_documents()}
    held_out = "night-shift-log.txt"
    calibration = ([(path.name, path.read_text(errors="replace")) for path in calibration_files]
                   or [(name, text) for name, text in samples.items() if name != held_out])
    return calibration, eval_file.read_text(errors="replace") if eval_file else samples[held_out]


def print_fidelity(results: Sequence[dict], caption: str) -> None:
    table = Table("capacity scale", "overflow", "tiers", "dropped", "spilled", "padding", "top-1 agreement",
                  "mean KL", "tokens/s", caption=caption, caption_justify="left")
    for row in results:
        table.add_row(_ratio(row.get("capacity_scale")), row.get("overflow", "exact model"),
                      " ".join(map(str, row.get("tiers", []))), _percent(row.get("dropped_fraction")),
                      _percent(row.get("spilled_fraction")), _percent(row.get("padding_fraction")),
                      f"{row['top1_agreement']:.1%}", _error(row["mean_kl"]), _number(row["tokens_per_s"]))
    _console().print(table)


def print_results(results: Sequence[dict], case_keys: Sequence[str], caption: str, machine: dict | None = None, *,
                  baseline: str | None = None) -> None:
    """One table per case (the values of `case_keys`), the engine's best exact path, what did another's work, and
    why any implementation was skipped or refused; a warning line above each table when the run was overloaded."""
    from .fair.paired import best_engine_row, clearly_faster, ratio_range
    from .machine import load_warning
    from .paths import ENGINE_PATHS, QUANTIZED_PATHS

    console = _console()
    warning = load_warning(machine or {})
    cases: dict[tuple, list[dict]] = {}
    for row in results:
        cases.setdefault(tuple(row[key] for key in case_keys), []).append(row)
    for case, rows in cases.items():
        title = ", ".join(f"{key} {value}" for key, value in zip(case_keys, case, strict=True))
        if warning:
            console.print(warning, style="bold yellow", highlight=False)
        console.print(results_table(rows, title, baseline))
        named = {row["impl"]: row for row in rows}
        for row in rows:
            twin = named.get(row.get("same_work_as", ""))
            if twin is not None and "round_seconds" in row and "round_seconds" in twin:
                low, _, high = ratio_range(row, twin)
                console.print(f"  {row['impl']} ran {twin['impl']}'s code (nothing in graphs): not a path of its own; "
                              f"their ratio ran {low:.2f}-{high:.2f} round by round, the noise of this run",
                              highlight=False)
        best = best_engine_row(rows)
        if best is not None:
            ratios = ([f"{best['vs_transformers_best']:.2f}× transformers' best"] if "vs_transformers_best" in best
                      else [])
            if f"vs_{baseline}" in best:
                ratios.append(f"{best[f'vs_{baseline}']:.0%} of the {baseline}")
            others = [r["impl"] for r in rows if r is not best and r["impl"] in ENGINE_PATHS
                      and ENGINE_PATHS[r["impl"]].exact and "tokens_per_s" in r and "same_work_as" not in r]
            why = (f"faster than {', '.join(others)} in more than three rounds in four"
                   if others and all(clearly_faster(best, named[o]) for o in others)
                   else "the CPU path: no other exact path was faster in more than three rounds in four" if others
                   else "the only exact path of its own")
            console.print(f"  engine's best exact path: {best['impl']} ({why}), {', '.join(ratios)}", highlight=False)
            for row in rows:
                if row["impl"] in QUANTIZED_PATHS and "tokens_per_s" in row:
                    low, _, high = ratio_range(row, best)
                    console.print(f"  {row['impl']}: {row['tokens_per_s'] / best['tokens_per_s']:.2f}× the engine's "
                                  f"best exact path ({low:.2f}-{high:.2f} round by round, relative error "
                                  f"{row['rel_error']:.1%})", highlight=False)
        for row in rows:
            if "error" in row:
                console.print(f"  {row['impl']} {row['status']}: {row['error']}", style="red", highlight=False)
    console.print(f"{caption} {LEGEND}", style="dim", highlight=False)


LEGEND = ("Ratios: of medians, with the lowest and highest of the ratio taken round by round in brackets. load s: "
          "from the float weights in memory to the first chunk ready (packing, quantizing, kernel choice from this "
          "machine's kernel cache, as a second run finds it). A quantized row's × roofline is against its format's "
          "roofline row, priced at the format's bytes.")


def results_table(rows: Sequence[dict], title: str, baseline: str | None = None) -> Table:
    """One line per implementation: speed, ratios with their round-by-round ranges, load time, what the engine did
    with the assignments, its error."""
    columns = {"tokens/s": lambda r: _number(r.get("tokens_per_s")),
               "× transformers": lambda r: _ratio_range(r, "vs_transformers_best")}
    if baseline:
        columns[f"× {baseline}"] = lambda r: _ratio_range(r, f"vs_{baseline}")
    columns |= {"load s": lambda r: _seconds(r.get("load_s")),
                "in graphs": lambda r: _percent(r.get("static_fraction")),
                "padding": lambda r: _percent(r.get("padding_fraction")),
                "spilled": lambda r: _percent(r.get("spilled_fraction")),
                "dropped": lambda r: _percent(r.get("dropped_fraction")),
                "rel. error": lambda r: _error(r.get("rel_error"))}
    table = Table(Column("impl", no_wrap=True), *columns, Column("note", no_wrap=True), title=title,
                  title_justify="left")
    for row in rows:
        table.add_row(row["impl"], *(cell(row) for cell in columns.values()), _note(row))
    return table


def _ratio_range(row: dict, key: str) -> str:
    """A ratio and, where it was paired round by round, its lowest and highest: 1.52 (1.40-1.61)."""
    if key not in row:
        return ""
    spread = row.get(f"{key}_range")
    return _ratio(row[key]) + (f" ({spread[0]:.2f}-{spread[2]:.2f})" if spread and len(row["round_seconds"]) > 1
                               else "")


def _console() -> Console:
    """Wide enough for the tables when the output is a file or a pipe (a terminal sets its own width)."""
    return Console(width=None if sys.stdout.isatty() else 230)


def _note(row: dict) -> str:
    if row["status"] in ("skipped", "refused"):
        return f"[red]{row['status']}[/red]"
    if "note" in row:  # a row that says what it is itself (bench/peer's)
        return row["note"]
    if "same_work_as" in row:
        return f"ran {row['same_work_as']}'s code"
    if row["status"] == "approximate":
        return f"approximate: {row['quantized']}" if "quantized" in row else "approximate: prunes"
    if "bound" not in row:
        return ""
    return f"{row['bound']}-bound" + (f" ({row['compute_kernel']})" if row["bound"] == "compute" else "")


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def _seconds(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def _percent(value: float | None) -> str:
    return "" if value is None else f"{value:.1%}"


def _error(value: float | None) -> str:
    return "" if value is None else f"{value:.1e}"


def print_profile(rows: Sequence[dict], case_keys: Sequence[str], machine: dict) -> None:
    """One table per case and profiled path: each part's milliseconds, share and distance from its roofline, a
    column per depth."""
    from rich.table import Table

    console = _console()
    cases: dict[tuple, list[dict]] = {}
    for row in rows:
        cases.setdefault((row["profiled"], *(row[key] for key in case_keys)), []).append(row)
    for (profiled, *case), case_rows in cases.items():
        depths = sorted({row["depth"] for row in case_rows})
        table = Table(title=f"profile of {profiled}, " + ", ".join(f"{k} {v}" for k, v in zip(case_keys, case,
                                                                                             strict=True)))
        table.add_column("part")
        for depth in depths:
            table.add_column(f"depth {depth:,}: ms (share, × roofline)", justify="right")
        for part in dict.fromkeys(row["part"] for row in case_rows):
            cells = []
            for depth in depths:
                row = next(r for r in case_rows if r["part"] == part and r["depth"] == depth)
                distance = "—" if row["x_roofline"] is None else f"{row['x_roofline']}×"
                cells.append(f"{row['ms']:,.1f} ({row['share']:.0%}, {distance})")
            table.add_row(part, *cells)
        table.caption = (f"Exclusive time per part in the chunk starting at each depth. Roofline: the part's "
                         f"FLOPs at this machine's dense-matmul rate or its bytes at {machine['copy_bandwidth_gbps']}"
                         f" GB/s, whichever is slower; — where the part's work is not counted.")
        console.print(table)


def _progress(row: dict) -> None:
    if row["impl"] == "profile":
        return
    case = " ".join(str(row[key]) for key in ("geometry", "tokens", "dtype", "capacity_scale") if key in row)
    speed = f"{row['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in row else row["status"]
    _err.print(f"{case} {row['impl']}: {speed}".strip(), style="dim", highlight=False)


def _write_json(path: Path | None, machine: dict, settings: dict, results: list[dict]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine, "settings": settings, "results": results}, indent=1) + "\n")
    _err.print(f"wrote {path}")


@bench.command("queue")
@click.option("--processes", type=click.IntRange(min=1), default=4, show_default=True,
              help="OS processes claiming at once.")
@click.option("--jobs", "n_jobs", type=click.IntRange(min=1), default=2000, show_default=True,
              help="Jobs in the queue.")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="Fresh queues drained; the median is reported.")
@click.option("--url", help="Also a PostgreSQL queue at this postgresql://… URL (a schema of its own, dropped after).")
def queue_bench(processes: int, n_jobs: int, rounds: int, url: str | None) -> None:
    """Queue claim throughput: processes draining one queue (claim + complete); duplicates and losses.

    SQLite always; with --url, PostgreSQL too, in the same run, rounds taken in turn.
    """
    import statistics

    from .service.queue import fresh_queue, run_claim_benchmark

    queues = {"sqlite": None, **({"postgresql": url} if url else {})}
    runs: dict[str, list] = {name: [] for name in queues}
    for _ in range(rounds):
        for name, server in queues.items():
            with fresh_queue(server) as location:
                runs[name].append(run_claim_benchmark(location, processes=processes, jobs=n_jobs))
    table = Table("queue", "round", "jobs/s", "seconds", "duplicates", "lost",
                  title=f"{processes} processes × {n_jobs} jobs")
    for name, done in runs.items():
        for i, run in enumerate(done, 1):
            table.add_row(name, str(i), f"{run.jobs_per_second:,.0f}", f"{run.seconds:.2f}", str(run.duplicates),
                          str(run.lost))
    Console().print(table)
    for name, done in runs.items():
        click.echo(f"{name}: median {statistics.median(r.jobs_per_second for r in done):,.0f} jobs/s; "
                   f"duplicates {sum(r.duplicates for r in done)}, lost {sum(r.lost for r in done)}")


@bench.command("search")
@click.option("--documents", type=click.IntRange(min=1), default=10_000, show_default=True,
              help="Documents in the index.")
@click.option("--chunks", type=click.IntRange(min=1), default=8, show_default=True, help="Chunks per document.")
@click.option("--dim", "dims", multiple=True, type=click.IntRange(min=1), default=(64, 2048), show_default=True,
              help="Vector width (repeatable); 64 is the demo model's.")
@click.option("-k", "k", type=click.IntRange(min=1), default=10, show_default=True, help="Chunks asked for.")
@click.option("--queries", type=click.IntRange(min=1), default=50, show_default=True, help="Timed queries.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for the vectors.")
@_json_option
def search_bench(documents: int, chunks: int, dims: tuple[int, ...], k: int, queries: int, seed: int,
                 json_path: Path | None) -> None:
    """Search query latency on an index of random vectors (sqlite-vec, exact): median and p95 for k chunks."""
    import dataclasses
    import tempfile

    from .machine import describe_machine
    from .service.search import run_search_benchmark

    results = []
    with tempfile.TemporaryDirectory() as folder:
        for dim in dims:
            _err.print(f"filling {documents:,} documents × {chunks} chunks at {dim} dimensions", style="dim")
            results.append(run_search_benchmark(Path(folder), dim=dim, documents=documents, chunks=chunks, k=k,
                                                queries=queries, seed=seed))
    table = Table("dim", "chunks", "fill s", "MB", f"median ms (k={k})", "p95 ms",
                  title=f"search: {documents:,} documents × {chunks} chunks, {queries} queries")
    for r in results:
        table.add_row(str(r.dim), f"{r.documents * r.chunks_per_document:,}", f"{r.fill_seconds:.1f}",
                      f"{r.database_mb:,.0f}", f"{r.median_ms:.1f}", f"{r.p95_ms:.1f}")
    Console().print(table)
    _write_json(json_path, describe_machine(1), {"documents": documents, "chunks": chunks, "k": k,
                                                  "queries": queries, "seed": seed},
                [dataclasses.asdict(r) for r in results])


@bench.command("query-latency")
@click.option("--home", type=click.Path(file_okay=False, exists=True, path_type=Path), required=True,
              help="A home whose documents are processed and indexed (e.g. the demo's: make demo).")
@click.option("--runs", type=click.IntRange(min=1), default=5, show_default=True, help="Timed searches.")
@click.option("--query", default=None, help="The query (default: the README's example).")
@_json_option
def query_latency_bench(home: Path, runs: int, query: str | None, json_path: Path | None) -> None:
    """Whole `npumoed search` commands, each embedding its query with the search model."""
    from .machine import describe_machine
    from .service.query_latency import QUERY, measure, summary_lines

    result = measure(home, runs, query or QUERY)
    for line in summary_lines(result):
        click.echo(line)
    _write_json(json_path, describe_machine(1), {"home": str(home), "runs": runs}, [result])


@bench.command("retrieval")
@click.option("--set", "question_set", type=click.Choice(["written", "samples"]), default="written", show_default=True,
              help="The questions: the written set's (bench/retrieval_set) or the six samples'.")
@click.option("--vectors", "vector_kinds", multiple=True, type=click.Choice(["search-model", "engine"]),
              default=("search-model", "engine"), show_default=True,
              help="Whose vectors are measured: the search model's or the engine's (repeatable).")
@click.option("--model", "model_name",
              help="The engine's model: \"demo\", a checkpoint folder or a Hugging Face id (default: the config's).")
@click.option("--pooling", "poolings", multiple=True, type=click.Choice(POOLINGS), default=POOLINGS,
              show_default=True, help="How the engine's chunk vectors are made (repeatable).")
@click.option("--documents", "n_documents", type=click.IntRange(min=1),
              help="Only the first N documents (by file name) and their questions: the engine is slow.")
@click.option("--threads", type=click.IntRange(min=1), help="torch threads (default: leave as is).")
@_json_option
def retrieval_bench(question_set: str, vector_kinds: tuple[str, ...], model_name: str | None,
                    poolings: tuple[str, ...], n_documents: int | None, threads: int | None,
                    json_path: Path | None) -> None:
    """Retrieval: recall@1, recall@3 and MRR of paraphrased questions, for each way of making vectors and each
    weighting of vectors against words."""
    import dataclasses

    import torch

    from npumoe.jobs.search.sentence_model import sentence_model

    from .machine import describe_machine
    from .service.questions import QUESTIONS, written_set
    from .service.retrieval import EngineVectors, SearchModelVectors, compare, sample_texts

    texts, questions = written_set() if question_set == "written" else (sample_texts(), QUESTIONS)
    if n_documents is not None:
        texts = dict(sorted(texts.items())[:n_documents])
        questions = tuple(q for q in questions if q.filename in texts)
    makers: list = [SearchModelVectors(sentence_model())] if "search-model" in vector_kinds else []
    engine = _retrieval_engine(model_name, threads) if "engine" in vector_kinds else None
    settings = {"set": question_set, "documents": len(texts), "vectors": list(vector_kinds)}
    if engine is not None:
        makers += [EngineVectors(engine, pooling) for pooling in poolings]
        settings |= {"model_key": engine.model_key, "chunk_tokens": engine.chunk_tokens, "poolings": list(poolings)}
    try:
        results = compare(makers, texts, questions=questions)
    finally:
        if engine is not None:
            engine.close()
    table = Table("vectors", "cosine/words/phrase", "passage R@1", "passage MRR", "document R@1", "document R@3",
                  "document MRR", title=f"retrieval: {len(questions)} questions on {len(texts)} documents")
    for r in results:
        w = r.weights
        table.add_row(r.vectors, f"{w.cosine:.2f}/{w.words:.3f}/{w.phrase:.3f}", f"{r.passage_recall_at_1:.3f}",
                      f"{r.passage_mrr:.3f}", f"{r.document_recall_at_1:.3f}", f"{r.document_recall_at_3:.3f}",
                      f"{r.document_mrr:.3f}")
    Console().print(table)
    click.echo(f"chance: passage R@1 {results[0].passage_chance:.3f}, document R@1 {results[0].document_chance:.3f}")
    _write_json(json_path, describe_machine(torch.get_num_threads()), settings,
                [dataclasses.asdict(r) for r in results])


def _retrieval_engine(model_name: str | None, threads: int | None) -> Engine:
    """The configured engine (or `model_name`'s), as the daemon would load it."""
    import dataclasses

    from npumoe.daemon.config import load_config
    from npumoe.daemon.home import Home
    from npumoe.daemon.model_choice import engine_settings, load_engine

    config = load_config(None)
    if model_name is not None:
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, name=model_name))
    engine = load_engine(engine_settings(config, Home.current().ensure(), threads=threads))
    _err.print(f"measuring {engine.model_key}", style="dim")
    return engine
