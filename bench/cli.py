"""`npumoed bench`: the benchmarks' commands (the MoE layer, whole-model prefill, decode, fidelity, memory, sections,
the queue, search, query latency, retrieval, and the daemon in the foreground).

`npumoed` loads this group lazily (daemon/cli/__init__.py). torch and transformers are imported inside the
commands, so `npumoed --help` stays fast. Each command prints a table (bench/render.py) and, with --json, writes
{"machine": ..., "settings": ..., "results": [...]} for the results folder.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import click

from npumoe.engine.vocabulary import (
    AUTO,
    BF16,
    CHUNK_TOKENS,
    FP32,
    INT4,
    INT8,
    QUANTIZED,
    SUMMARY_TOKENS,
    WEIGHTS,
    WEIGHTS_DTYPE,
)

from .document.run import document
from .document.target import make_target_command
from .fidelity.run import FIDELITY_FAMILIES
from .memory import GGUF_TYPES
from .options import (
    cuda_option,
    dtype_option,
    json_option,
    measured_dtypes,
    parse_geometries,
    require_matplotlib,
    rounds_options,
    threads_option,
    timing_options,
    write_json,
)

if TYPE_CHECKING:
    from npumoe.engine.synthetic.geometry import Geometry
from .render import (
    err_console,
    print_memory,
    print_profile,
    print_progress,
    print_results,
    print_sections,
    wide_console,
)
from .service.commands import query_latency_bench, queue_bench, retrieval_bench, search_bench
from .service.foreground import foreground


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def bench() -> None:
    """Benchmarks: print a table, optionally write JSON with the machine description."""


for command in (foreground, queue_bench, search_bench, query_latency_bench, retrieval_bench, document,
                make_target_command):
    bench.add_command(command)


@bench.command("moe")
@click.option("--geometry", "geometries", multiple=True, default=("qwen3-30b-a3b",), show_default=True,
              help="MoE layer geometry (repeatable): a model named in engine/synthetic/geometries.json (e.g. "
                   "qwen3-30b-a3b, gpt-oss-20b, olmoe-1b-7b), or HIDDENxEXPERTSxTOPKxFFN.")
@click.option("--tokens", multiple=True, type=click.IntRange(min=1), default=(CHUNK_TOKENS,), show_default=True,
              help="Prefill chunk length in tokens (repeatable).")
@dtype_option("Weight and activation dtype (repeatable).")
@click.option("--skew", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="Zipf exponent of expert popularity in the generated routing (0: uniform).")
@click.option("--calibration-chunks", type=click.IntRange(min=1), default=8, show_default=True,
              help="Routing draws the engine's plan is calibrated on.")
@click.option("--weights", "weights", multiple=True, type=click.Choice(QUANTIZED),
              help="Also run the engine's CPU path with its experts quantized to this format (repeatable); "
                   "approximate rows, timed when within the format's error bound.")
@cuda_option
@threads_option
@timing_options
@rounds_options
@json_option
def moe(geometries: tuple[str, ...], tokens: tuple[int, ...], dtypes: tuple[str, ...], skew: float,
        calibration_chunks: int, weights: tuple[str, ...], cuda: bool, threads: int, warmup: int, repeats: int,
        seed: int, min_seconds: float, own_process: bool, json_path: Path | None) -> None:
    """MoE-layer prefill throughput on random weights: transformers' experts vs the engine vs the roofline."""
    if cuda:
        _require_gpu()
    parsed = parse_geometries(geometries)
    dtypes = measured_dtypes(dtypes, parsed)
    import torch

    from .layer.moe import MoeBenchSettings, run_moe_bench
    from .layer.roofline import MODEL
    from .machine import describe_machine, sampled_load

    torch.set_num_threads(threads)
    machine = describe_machine(threads)
    settings = MoeBenchSettings(threads=threads, warmup=warmup, repeats=repeats, seed=seed, skew=skew,
                                calibration_chunks=calibration_chunks, weights=weights, min_seconds=min_seconds,
                                own_process=own_process)
    if cuda:
        from .gpu.rows import CUDA_PER_EXPERT, run_cuda_moe_bench

        results = run_cuda_moe_bench(parsed, tokens, dtypes, settings, on_result=print_progress)
        print_results(results, ("geometry", "tokens", "dtype"), "On the GPU (bench/gpu/rows.py).", machine,
                      baseline=CUDA_PER_EXPERT)
        write_json(json_path, machine, {"cuda": True, "warmup": warmup, "repeats": repeats, "seed": seed,
                                         "skew": skew, "calibration_chunks": calibration_chunks}, results)
        return
    with sampled_load(machine):
        results = run_moe_bench(parsed, tokens, dtypes, settings, bandwidth=machine["copy_bandwidth_gbps"] * 1e9,
                                on_result=print_progress)
    caption = (f"× transformers: against transformers' fastest implementation in the same case. {MODEL}. "
               f"{threads} threads, copy bandwidth {machine['copy_bandwidth_gbps']} GB/s, {machine['cpu']}; "
               f"routing Zipf skew {skew}.")
    print_results(results, ("geometry", "tokens", "dtype"), caption, machine, baseline="roofline")
    _print_host_packing(parsed, tokens, dtypes, seed=seed, skew=skew, repeats=repeats)
    write_json(json_path, machine, {"warmup": warmup, "repeats": repeats, "min_seconds": min_seconds,
                                    "own_process": own_process, "seed": seed, "skew": skew,
                                    "calibration_chunks": calibration_chunks, "weights": list(weights),
                                    "roofline_model": MODEL}, results)


def _print_host_packing(geometries: Sequence[Geometry], tokens: tuple[int, ...], dtypes: Sequence[str], *,
                        seed: int, skew: float, repeats: int) -> None:
    """One line per case: the host's packing and unpacking of a layer call with every expert resident (forced
    placement), on the accelerator's critical path whatever the accelerator."""
    from npumoe.engine.loading.load import TORCH_DTYPES

    from .layer.host_packing import host_packing_seconds

    for geometry in geometries:
        for dtype in dtypes:
            for n in tokens:
                host = host_packing_seconds(geometry, n, TORCH_DTYPES[dtype], seed=seed, skew=skew, repeats=repeats)
                click.echo(f"host packing per layer call, every expert resident ({geometry.name}, {n} tokens, "
                           f"{dtype}): pack {host['pack_s'] * 1e3:.2f} ms, unpack {host['unpack_s'] * 1e3:.2f} ms")


@bench.command("prefill")
@click.option("--geometry", "geometries", multiple=True, default=("qwen3-30b-a3b",), show_default=True,
              help="Model geometry (repeatable): a name as for `bench moe`, or HIDDENxEXPERTSxTOPKxFFN.")
@click.option("--layers", type=click.IntRange(min=1), default=2, show_default=True,
              help="Decoder layers at the real sizes (the rest of the model is left out).")
@click.option("--document-tokens", type=click.IntRange(min=1), default=2048, show_default=True,
              help="Length of the prefilled document (e.g. 2048, 8192, 16384, 32768: attention grows with depth).")
@click.option("--chunk", "chunk_tokens", type=click.IntRange(min=1), default=CHUNK_TOKENS, show_default=True,
              help="Prefill chunk length; the KV cache carries across chunks.")
@dtype_option("Model dtype (repeatable).")
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
@cuda_option
@threads_option
@timing_options
@rounds_options
@json_option
def prefill(geometries: tuple[str, ...], layers: int, document_tokens: int, chunk_tokens: int,
            dtypes: tuple[str, ...], calibration_documents: int, weights: tuple[str, ...], profile: bool,
            peer_dir: Path | None, cuda: bool, threads: int, warmup: int, repeats: int, seed: int,
            min_seconds: float, own_process: bool, json_path: Path | None) -> None:
    """Whole-model document prefill tokens/s on random weights: the engine vs plain transformers (and llama.cpp)."""
    if cuda:
        _require_gpu()
    parsed = parse_geometries(geometries)
    dtypes = measured_dtypes(dtypes, parsed)
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
    if cuda:
        from .gpu.rows import CUDA_PER_EXPERT, run_cuda_prefill_bench

        results = run_cuda_prefill_bench(parsed, dtypes, settings, on_result=print_progress)
        print_results(results, ("geometry", "layers", "dtype", "document_tokens", "chunk_tokens"),
                      "On the GPU (bench/gpu/rows.py); the engine's dense parts on the CPU.", machine,
                      baseline=CUDA_PER_EXPERT)
        write_json(json_path, machine, {"cuda": True, "warmup": warmup, "repeats": repeats, "seed": seed,
                                         "layers": layers, "calibration_documents": calibration_documents}, results)
        return
    with sampled_load(machine):
        results = run_prefill_bench(parsed, dtypes, settings, bandwidth=machine["copy_bandwidth_gbps"] * 1e9,
                                    peers=peers, on_result=print_progress)
    caption = (f"× transformers: against transformers' fastest implementation in the same case. Random weights, "
               f"random-token documents, chunked prefill with the KV cache carried. {threads} threads, "
               f"{machine['cpu']}.")
    case_keys = ("geometry", "layers", "dtype", "document_tokens", "chunk_tokens")
    print_results([row for row in results if row["impl"] != "profile"], case_keys, caption, machine)
    for line in peer_lines(results):
        wide_console().print(line, highlight=False)
    if profile:
        print_profile([row for row in results if row["impl"] == "profile"], case_keys, machine)
    write_json(json_path, machine, {"warmup": warmup, "repeats": repeats, "min_seconds": min_seconds,
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
@click.option("--peer", "peer_dir", type=click.Path(file_okay=False, path_type=Path),
              help="With --model FILE.gguf: instead of the parts above, the engine's perplexity on the file beside "
                   "llama.cpp's llama-perplexity on the same tokens (the sample documents, or --eval-text), from "
                   "this llama.cpp build folder (bench/peer/build-llama-cpp.sh).")
@click.option("--context", type=click.IntRange(min=4), default=512, show_default=True,
              help="With --peer: llama-perplexity's chunk (-c); each chunk's second half is scored.")
@click.option("--weights", type=click.Choice(WEIGHTS), default=AUTO, show_default=True,
              help="With --peer: the engine's weights format, as the daemon's setting.")
@threads_option
@timing_options
@json_option
def fidelity(model_name: str | None, tokens_per_document: int, calibration_files: tuple[Path, ...],
             eval_file: Path | None, scales: tuple[float, ...], chunk_tokens: int, eval_tokens: int,
             plot_path: Path | None, families: tuple[str, ...], layer_geometry: str, layer_tokens: int,
             capacity: bool, layer: bool, peer_dir: Path | None, context: int, weights: str, threads: int,
             warmup: int, repeats: int, seed: int, json_path: Path | None) -> None:
    """Accuracy against capacity (dropped, spilled and padding fractions, top-1 agreement and KL vs the exact
    model), and against the weights' format (bf16, int8, int4 vs fp32, whole model and one real-size layer); with
    --peer, perplexity against llama.cpp's on the same GGUF file."""
    if peer_dir is not None:
        _peer_fidelity(model_name, peer_dir, eval_file, context, chunk_tokens, weights, threads, json_path)
        return
    if plot_path is not None:
        require_matplotlib()
    import torch

    from npumoe.daemon.cli.model_ref import model_ref
    from npumoe.engine.errors import ModelError

    from .fidelity.run import FidelityRun, fidelity_texts, run_fidelity_benches
    from .machine import describe_machine

    model_path = Path(model_ref(model_name)) if model_name else None
    calibration_texts, eval_text = fidelity_texts(calibration_files, eval_file)
    run = FidelityRun(model_name=model_name, model_path=model_path, calibration_texts=calibration_texts,
                      eval_text=eval_text, scales=scales, chunk_tokens=chunk_tokens, eval_tokens=eval_tokens,
                      tokens_per_document=tokens_per_document,
                      families=families, layer_geometry=parse_geometries([layer_geometry])[0],
                      layer_tokens=layer_tokens, capacity=capacity, layer=layer, threads=threads, warmup=warmup,
                      repeats=repeats, seed=seed)
    torch.set_num_threads(threads)
    machine = describe_machine(threads)
    try:
        measured = run_fidelity_benches(run, machine)
    except (ModelError, ValueError) as e:
        raise click.ClickException(str(e)) from e
    if plot_path is not None and capacity:
        from .fidelity.plot import fidelity_figure

        plot_path.parent.mkdir(parents=True, exist_ok=True)
        fidelity_figure([row for row in measured.rows if "section" not in row]).savefig(plot_path, dpi=120)
        err_console.print(f"wrote {plot_path}")
    write_json(json_path, machine, {"model": measured.model_name, "model_key": measured.model_key, "seed": seed,
                                    "calibration": [name for name, _ in calibration_texts], "warmup": warmup,
                                    "repeats": repeats}, measured.rows)


def _peer_fidelity(model_name: str | None, peer_dir: Path, eval_file: Path | None, context: int, chunk_tokens: int,
                   weights: str, threads: int, json_path: Path | None) -> None:
    """`bench fidelity --peer`: the engine and llama-perplexity on one GGUF file and the same tokens."""
    import torch

    from npumoe.daemon.samples import sample_documents
    from npumoe.engine.errors import ModelError

    from .fidelity.peer import PeerFidelitySettings, run_peer_fidelity
    from .machine import describe_machine
    from .peer.llama_cpp import find_llama_cpp
    from .render import print_peer_fidelity

    model = Path(model_name).expanduser() if model_name else None
    if model is None or not model.is_file() or model.suffix != ".gguf":
        raise click.BadParameter("--peer compares the engine with llama.cpp on a GGUF file: give --model FILE.gguf",
                                 param_hint="--model")
    try:
        tool = find_llama_cpp(peer_dir)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--peer") from e
    text = (eval_file.read_text(errors="replace") if eval_file
            else "\n\n".join("\n\n".join(doc.paragraphs) for doc in sample_documents()))
    torch.set_num_threads(threads)
    machine = describe_machine(threads)
    settings = PeerFidelitySettings(context=context, chunk_tokens=chunk_tokens, threads=threads, weights=weights)
    try:
        row = run_peer_fidelity(model, tool, text, settings,
                                on_progress=lambda line: err_console.print(line, style="dim", highlight=False))
    except (ModelError, ValueError) as e:
        raise click.ClickException(str(e)) from e
    print_peer_fidelity(row, f"{model.name}: {row['chunks']} chunks of {row['context']} tokens of "
                             f"{eval_file.name if eval_file else 'the sample documents'}, the second half of each "
                             f"scored ({row['scored_tokens']} tokens), the same tokens in both; {threads} threads, "
                             f"{machine['cpu']}. The engine's experts: {row['engine_conversions'] or 'none read'}")
    write_json(json_path, machine, {"model": str(model), "text": str(eval_file) if eval_file else "samples",
                                    "context": context, "chunk_tokens": chunk_tokens, "weights": weights,
                                    "peer": tool.describe()}, [{"section": "peer", **row}])


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
@threads_option
@json_option
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
    measured = model_path or f"{geometry_name}, {layers} layers"
    print_memory(results, f"{measured}; load + one {document_tokens}-token document; peak RSS minus the RSS before "
                          f"loading, target ≤ {TARGET_RATIO} × the weights' bytes in the format loaded. {threads} "
                          f"threads, {machine['cpu']}.")
    write_json(json_path, machine, {"geometry": geometry_name, "layers": layers, "document_tokens": document_tokens,
                                    "gguf_types": list(gguf_types), "model": str(model_path) if model_path else None},
               results)


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
@threads_option
@json_option
def sections(geometry_name: str, layers: int, document_tokens: int, sections: tuple[int, ...], chunk_tokens: int,
             summary_tokens: int, weights: str, threads: int, json_path: Path | None) -> None:
    """Section length against throughput and how far the vectors move: the trade [model] section_tokens makes."""
    from .machine import describe_machine
    from .sections import DOCUMENT_COSINE, SectionBenchSettings, run_sections_bench

    try:
        settings = SectionBenchSettings(geometry=geometry_name, layers=layers, document_tokens=document_tokens,
                                        section_tokens=sections, chunk_tokens=chunk_tokens,
                                        summary_tokens=summary_tokens, weights=weights, threads=threads)
        results = run_sections_bench(settings, on_result=lambda row: err_console.print(
            f"section {row['section_tokens']}: {row['tokens_per_s']:,.1f} tokens/s, {row['sections']} sections, "
            f"document cosine {row['document_cosine']:.4f}", style="dim", highlight=False))
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    machine = describe_machine(threads)
    print_sections(results, f"{geometry_name}, {layers} layers, {weights}, random weights; one {document_tokens}-token "
                            f"document, chunk {chunk_tokens}, summaries of at most {summary_tokens} tokens. Cosines "
                            f"against the first row (the longest sections). * the fastest whose document vector keeps "
                            f"cosine ≥ {DOCUMENT_COSINE}. {threads} threads, {machine['cpu']}.")
    write_json(json_path, machine, settings.__dict__, results)


@bench.command("decode")
@click.option("--model", "model_name", default="demo", show_default=True,
              help="demo (the demo MoE's checkpoint) or a checkpoint folder.")
@click.option("--weights", "formats", multiple=True, type=click.Choice((FP32, BF16, INT8, INT4)),
              default=(FP32, BF16, INT8), show_default=True,
              help="Weights format (repeatable); every format's engine is loaded and the rounds interleave them.")
@click.option("--depth", type=click.IntRange(min=2), default=512, show_default=True,
              help="Tokens prefilled before decoding starts.")
@click.option("--tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="Tokens decoded per round (fewer when the model stops).")
@click.option("--rounds", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--head-torch", is_flag=True,
              help="Also run each format with the LM head on plain torch, interleaved (the head kernel's A/B).")
@click.option("--profile", is_flag=True, help="Also charge one decode run's time to the model's parts.")
@threads_option
@json_option
def decode(model_name: str, formats: tuple[str, ...], depth: int, tokens: int, rounds: int, head_torch: bool,
           profile: bool, threads: int, json_path: Path | None) -> None:
    """Greedy decode tokens/s from a prefilled cache through the engine, per weights format."""
    from npumoe.daemon.model_choice import resolve_model

    from .decode import DecodeSettings, run_decode_bench
    from .machine import describe_machine, sampled_load

    settings = DecodeSettings(depth=depth, tokens=tokens, rounds=rounds, threads=threads, head_torch=head_torch,
                              profile=profile)
    model = resolve_model(model_name)
    machine = describe_machine(threads)
    with sampled_load(machine):
        results = run_decode_bench(model, formats, settings, on_result=lambda row: err_console.print(
            f"{row['weights']} ({row['head']}: {row['head_kernel']}): {row['tok_s']} tok/s "
            f"[{row['tok_s_min']}, {row['tok_s_max']}] {row.get('ms_per_step', '')}", highlight=False))
    for row in results:
        wide_console().print(f"{row['weights']:>5} {row['head']:<12} {row['head_kernel']:<24} depth {row['depth']} "
                             f"{row['tokens']} tokens: {row['tok_s']:6.2f} tok/s median "
                             f"[{row['tok_s_min']:.2f}, {row['tok_s_max']:.2f}] over {row['rounds']} rounds",
                             highlight=False)
    write_json(json_path, machine, settings.__dict__, results)


def _require_gpu() -> None:
    """A --cuda bench stops before anything is built where there is no GPU, saying why."""
    from .gpu.rows import require_cuda

    try:
        require_cuda()
    except ValueError as e:
        raise click.UsageError(str(e)) from e
