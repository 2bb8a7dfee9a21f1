"""`npumoed bench document`: whole documents as a person waits for them, decoding included, with llama.cpp beside.

    npumoed bench document [--model demo|FILE.gguf|FOLDER] [--sample NAME | --document FILE]... [--peer DIR]

The engine runs the daemon's own path: the model loaded with the settings the daemon makes from its config
(daemon/model_choice.engine_settings, on a temporary home), each document's text extracted in a child process as
the worker does (jobs/extract), then `Engine.process`: sections, chunked prefill, a summary per section, the combine.
Per document it reports the load seconds (once per run), prefill tokens/s (document tokens over prefill seconds),
decode tokens/s (tokens written over the summary and combine seconds, which also hold those prompts' few-token
prefills), the depth it decodes at (a section's tokens: the cache each section summary decodes after), the wall and
CPU seconds of extraction and processing (getrusage, this process and its children), and the process's peak RSS so far.

Beside it, on the same GGUF file and threads, llama.cpp (bench/peer/build-llama-cpp.sh, `--peer DIR` or
NPUMOE_LLAMA_CPP): `llama-bench` prefilling a section's tokens from an empty cache and generating the engine's
tokens-per-summary at the section's depth, and `llama-completion` doing the document's work one call at a time: each
section as its prompt, then (for several sections) a combine of as many tokens as the summaries held, each writing
the engine's mean tokens per call (the end of sequence ignored). llama.cpp runs once the engine's own process has
exited, so the two never hold a full-size model in memory at once. Where there is no build, or the model is not a GGUF
file, the llama.cpp row says so.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import resource
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from npumoe.engine.vocabulary import WEIGHTS

from ..memory import peak_rss, rss
from ..options import write_json
from ..render import err_console

RESULTS = Path(__file__).parent.parent / "results"
DEFAULT_SAMPLE = "battery-budget.html"
ENGINE, PEER = "npumoe", "llama.cpp"
# llama-completion's timing lines (llama_perf_context_print): "load time = 1234.56 ms", "total time = ..."
_PERF = re.compile(r"(?P<what>load|prompt eval|eval|total) time\s*=\s*(?P<ms>[\d.]+) ms")



@dataclass(frozen=True)
class DocumentBenchSettings:
    model: str = "demo"  # "demo", a GGUF file or a checkpoint folder, as `[model] name` takes it
    documents: tuple[Path, ...] = ()  # files to process; none: the DEFAULT_SAMPLE
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)
    summary_tokens: int | None = None  # None: the daemon's default
    section_tokens: int | None = None  # None: the daemon's default (the demo's own for the demo model)
    weights: str | None = None  # one of vocabulary.WEIGHTS; None: the daemon's default (the demo's own for the demo)
    peer: Path | None = None  # the llama.cpp build's folder
    repeats: int = 3  # llama-bench's timed runs
    engine_apart: bool = True  # the engine in a process of its own, gone before llama.cpp starts

    def __post_init__(self) -> None:
        if self.threads < 1 or self.repeats < 1:
            raise ValueError(f"threads and repeats must be positive, got {self.threads} and {self.repeats}")


def sample_paths(names: Sequence[str], folder: Path) -> list[Path]:
    """The daemon's sample documents named, written into `folder`."""
    from npumoe.daemon.samples import write_samples

    written = {path.name: path for path in write_samples(folder)}
    unknown = [name for name in names if name not in written]
    if unknown:
        raise ValueError(f"no sample named {', '.join(unknown)}; the samples: {', '.join(written)}")
    return [written[name] for name in names]


def run_document_bench(settings: DocumentBenchSettings,
                       on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """One engine row per document, each followed by its llama.cpp row; llama.cpp runs after the engine is closed
    (and, `engine_apart`, after its process has exited)."""
    with tempfile.TemporaryDirectory(prefix="npumoe-document-") as temporary:
        documents = list(settings.documents) or sample_paths([DEFAULT_SAMPLE], Path(temporary) / "samples")
        if settings.engine_apart:
            # The engine in a process of its own: its memory goes back to the system when it exits, where a closed
            # engine's would stay with this one (a full-size model's 19 GB beside llama.cpp's ran out of memory).
            with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as apart:
                rows, prompts, model = apart.submit(engine_rows, settings, documents, Path(temporary)).result()
        else:
            rows, prompts, model = engine_rows(settings, documents, Path(temporary))
        peer = _peer(settings, model)
        peer_rows = []
        for row, calls in zip(rows, prompts, strict=True):
            if on_result is not None:
                on_result(row)
            peer_rows.append({"document": row["document"], "model": settings.model,
                              **peer(calls, row, Path(temporary))})
            if on_result is not None:
                on_result(peer_rows[-1])
    for row, peer_row in zip(rows, peer_rows, strict=True):
        if peer_row["status"] == "ran":
            row["vs_llama_cpp"] = versus(row, peer_row)
    return [row for pair in zip(rows, peer_rows, strict=True) for row in pair]


def engine_rows(settings: DocumentBenchSettings, documents: Sequence[Path],
                scratch: Path) -> tuple[list[dict], list[list[str]], Path]:
    """The engine's row for each document, each document's llama.cpp calls (cut as the engine cut its sections),
    and the model file the engine loaded; the engine loaded once, on a home in `scratch`, and closed."""
    from npumoe.daemon.config import Config
    from npumoe.daemon.home import Home
    from npumoe.daemon.model_choice import engine_settings
    from npumoe.engine import Engine

    home = Home(scratch / "home")
    config = Config()
    model = replace(config.model, name=settings.model,
                    summary_tokens=settings.summary_tokens or config.model.summary_tokens,
                    section_tokens=settings.section_tokens or config.model.section_tokens,
                    weights=settings.weights or config.model.weights)
    engine_config = engine_settings(replace(config, model=model), home, threads=settings.threads)
    before, started = rss(), time.perf_counter()
    engine = Engine.load(engine_config)
    load_s = time.perf_counter() - started
    rows: list[dict] = []
    prompts: list[list[str]] = []
    try:
        for path in documents:
            row, text = _engine_row(engine, path)
            rows.append({"document": path.name, **row, "load_s": load_s, "rss_before_load": before,
                         "model": settings.model, "engine_pid": os.getpid()})
            prompts.append(_peer_prompts(engine.loaded.tokenizer, text, rows[-1]))
    finally:
        engine.close()
    return rows, prompts, Path(engine_config.model)


def versus(engine: dict, peer: dict) -> dict[str, float]:
    """The engine's rates over llama.cpp's, and llama.cpp's seconds for the document over the engine's (above 1:
    the engine is faster), where both rows hold the figure."""
    ratios = {key: engine[key] / peer[key] for key in ("prefill_tokens_per_s", "decode_tokens_per_s")
              if engine.get(key) and peer.get(key)}
    if engine.get("seconds") and peer.get("seconds"):
        ratios["seconds"] = peer["seconds"] / engine["seconds"]
    return ratios


def _cpu_seconds() -> float:
    """CPU seconds of this process and its waited-for children (the extraction's, llama.cpp's)."""
    return sum(usage.ru_utime + usage.ru_stime
               for usage in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))


def _engine_row(engine, path: Path) -> tuple[dict, str]:
    """The engine's row for the document at `path`, and the text extracted from it."""
    from npumoe.jobs.extract.isolated import extract_text

    started, cpu = time.perf_counter(), _cpu_seconds()
    extracted = extract_text(path)
    extract_s = time.perf_counter() - started
    result = engine.process(extracted.text)
    stats = result.stats
    seconds, cpu_seconds = time.perf_counter() - started, _cpu_seconds() - cpu
    decoding = stats.seconds["summary"] + stats.seconds["reduce"]
    calls = stats.sections + stats.reduce_rounds  # a summary per section, a combine per round
    return {"impl": ENGINE, "status": "ran", "format": extracted.format, "tokens": stats.tokens,
            "sections": stats.sections, "section_tokens": engine.section_tokens, "chunk_tokens": stats.chunk_tokens,
            "generated_tokens": stats.generated_tokens, "decode_calls": calls,
            "decode_depth": round(stats.tokens / stats.sections),
            "prefill_tokens_per_s": stats.tokens / stats.seconds["prefill"],
            "decode_tokens_per_s": stats.generated_tokens / decoding if decoding else None,
            "extract_s": extract_s, "phase_seconds": dict(stats.seconds), "seconds": seconds,
            "cpu_seconds": cpu_seconds, **_peak(peak_rss()), "summary": result.summary}, extracted.text


def _peak(peak: int) -> dict[str, float]:
    """A peak RSS in bytes, and in GiB as the tables show it."""
    return {"peak_rss": peak, "peak_rss_gib": round(peak / 2**30, 2)}


def _peer_prompts(tokenizer, text: str, row: dict) -> list[str]:
    """llama.cpp's prompts for the document's work: each section as the engine cut it, then, for several, a combine
    of as many tokens as the summaries it reads."""
    from npumoe.engine.generate.prefill import windows

    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    prompts = [tokenizer.decode(section) for section in windows(ids, row["section_tokens"])]
    if len(prompts) > 1:
        prompts.append(tokenizer.decode(ids[:_per_call(row) * len(prompts)]))
    return prompts


def _per_call(row: dict) -> int:
    """The engine's mean tokens written per summary or combine."""
    return max(1, round(row["generated_tokens"] / row["decode_calls"]))


def _peer(settings: DocumentBenchSettings, model: Path) -> Callable[..., dict]:
    """What makes a document's llama.cpp row: the runs, or a row saying why there are none."""
    from ..peer.llama_cpp import LLAMA_CPP_ENV, find_llama_cpp

    folder = settings.peer or (Path(os.environ[LLAMA_CPP_ENV]) if os.environ.get(LLAMA_CPP_ENV) else None)
    why = None
    if folder is None:
        why = f"no llama.cpp build named (bench/peer/build-llama-cpp.sh, then --peer DIR or {LLAMA_CPP_ENV})"
    elif not (model.is_file() and model.suffix == ".gguf"):
        why = f"the model is not a GGUF file ({model.name}): llama.cpp runs GGUF files only"
    if why is not None:
        return lambda *_: {"impl": PEER, "status": "skipped", "note": why}
    tool = find_llama_cpp(folder)

    def run(prompts: list[str], engine_row: dict, scratch: Path) -> dict:
        try:
            return {"impl": PEER, "status": "ran", "version": tool.version,
                    **_peer_runs(tool, model, prompts, engine_row, scratch, settings)}
        except (RuntimeError, OSError) as e:  # a broken peer run is reported, the engine's rows stand
            return {"impl": PEER, "status": "failed", "note": str(e)[-300:]}

    return run


def _peer_runs(tool, model: Path, prompts: list[str], engine_row: dict, scratch: Path,
               settings: DocumentBenchSettings) -> dict:
    from ..peer.llama_cpp import (
        bench_command,
        completion_command,
        completion_tool,
        decode_command,
        run_bench,
        run_completion,
    )

    threads, depth = settings.threads, engine_row["decode_depth"]
    per_call = _per_call(engine_row)
    prefill = run_bench(bench_command(tool, model, tokens=depth, chunk=engine_row["chunk_tokens"], threads=threads,
                                      warmup=1, repeats=settings.repeats), tokens=depth)
    decode = run_bench(decode_command(tool, model, tokens=per_call, depth=depth, threads=threads,
                                      repeats=settings.repeats), tokens=0, generated=per_call)
    row = {"decode_depth": depth, "generated_per_call": per_call, "prefill_tokens_per_s": prefill["avg_ts"],
           "decode_tokens_per_s": decode["avg_ts"], "llama_bench": {"prefill": prefill, "decode": decode}}
    completion = completion_tool(tool)
    if completion is None:
        return {**row, "note": f"no llama-completion or llama-cli beside {tool.bench}: no whole-document time"}
    timings: list[dict[str, float]] = []
    peak = 0
    started, cpu = time.perf_counter(), _cpu_seconds()
    for i, prompt in enumerate(prompts):
        file = scratch / f"prompt-{i}.txt"
        file.write_text(prompt)
        done = run_completion(completion_command(completion, model, file, tokens=per_call, threads=threads))
        timings.append({match["what"]: float(match["ms"]) / 1e3 for match in _PERF.finditer(done.stderr)})
        peak = max(peak, done.peak_rss)
    seconds, cpu_seconds = time.perf_counter() - started, _cpu_seconds() - cpu
    return {**row, "completion_tool": completion.name, "calls": len(prompts),
            "generated_tokens": per_call * len(prompts), "seconds": seconds, "cpu_seconds": cpu_seconds,
            "load_s": timings[0].get("load"), "call_seconds": timings, **_peak(peak)}


def results_stem(machine: dict, model: str, when: datetime | None = None) -> str:
    """document-<model>-<machine>-<date>: the model's file or folder name, the CPU and its logical cores."""
    when = when or datetime.now(UTC)
    cpu = re.sub(r"\((r|tm)\)|cpu|processor|@.*", "", machine["cpu"].lower())
    slug = "-".join(re.findall(r"[a-z0-9]+", f"{Path(model).stem} {cpu}"))
    return f"document-{slug}-{machine['logical_cores']}core-{when:%Y-%m-%d}"


def document_table(rows: Sequence[dict], caption: str) -> Table:
    gib = 2**30
    table = Table("document", "impl", "tokens", "sections", "decode depth", "generated", "load s", "prefill tok/s",
                  "decode tok/s", "seconds", "CPU s", "peak RSS GiB", "note", caption=caption, caption_justify="left")

    def number(value: float | None, spec: str) -> str:
        return "" if value is None else format(value, spec)

    for row in rows:
        table.add_row(row["document"], row["impl"], number(row.get("tokens"), ","), number(row.get("sections"), "d"),
                      number(row.get("decode_depth"), ","), number(row.get("generated_tokens"), ","),
                      number(row.get("load_s"), ".1f"), number(row.get("prefill_tokens_per_s"), ",.1f"),
                      number(row.get("decode_tokens_per_s"), ",.2f"), number(row.get("seconds"), ".1f"),
                      number(row.get("cpu_seconds"), ".1f"),
                      number(row["peak_rss"] / gib if "peak_rss" in row else None, ".2f"),
                      row.get("note") or ("" if row["status"] == "ran" else row["status"]))
    return table


@click.command("document")
@click.option("--model", default="demo", show_default=True,
              help="demo, a GGUF file (e.g. `bench make-target`'s) or a checkpoint folder, as [model] name takes it.")
@click.option("--sample", "samples", multiple=True,
              help=f"A sample document by name (repeatable; default {DEFAULT_SAMPLE} when no --document is given).")
@click.option("--document", "documents", multiple=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A document file to process (repeatable).")
@click.option("--summary-tokens", type=click.IntRange(min=1), default=None,
              help="Most tokens each summary and combine may write (default: the daemon's).")
@click.option("--section-tokens", type=click.IntRange(min=1), default=None,
              help="Longest section summarised on its own (default: the daemon's).")
@click.option("--weights", type=click.Choice(WEIGHTS), default=None,
              help="What the weights run in (default: the daemon's, auto; the demo model's own for the demo).")
@click.option("--peer", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="The llama.cpp build's folder (bench/peer/build-llama-cpp.sh; or NPUMOE_LLAMA_CPP).")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="llama-bench's timed runs per test.")
@click.option("--threads", type=click.IntRange(min=1), default=os.cpu_count(), show_default=True,
              help="Threads of the engine and of llama.cpp (default: all cores).")
@click.option("--out", "out_folder", type=click.Path(file_okay=False, path_type=Path), default=RESULTS,
              show_default=True, help="Where the JSON and the table's text are written.")
def document(model: str, samples: tuple[str, ...], documents: tuple[Path, ...], summary_tokens: int | None,
             section_tokens: int | None, weights: str | None, peer: Path | None, repeats: int, threads: int,
             out_folder: Path) -> None:
    """Whole documents through the daemon's path (extract, sections, prefill, summaries, combine), llama.cpp
    beside them on the same GGUF file; a table, and JSON with the machine."""
    from ..machine import describe_machine, load_warning, sampled_load

    with tempfile.TemporaryDirectory(prefix="npumoe-samples-") as folder:
        try:
            paths = [*documents, *sample_paths(samples, Path(folder))]
            settings = DocumentBenchSettings(model=model, documents=tuple(paths), threads=threads,
                                             summary_tokens=summary_tokens, section_tokens=section_tokens,
                                             weights=weights, peer=peer, repeats=repeats)
        except ValueError as e:
            raise click.UsageError(str(e)) from e
        load: dict = {}
        with sampled_load(load):
            rows = run_document_bench(settings, on_result=lambda row: err_console.print(
                f"{row['document']} {row['impl']}: {row['status']}", style="dim", highlight=False))
    machine = {**describe_machine(threads), **load}  # after the run: its bandwidth copy would be in the peak RSS
    console = Console(record=True, width=230)
    if warning := load_warning(machine):
        console.print(warning, style="bold yellow", highlight=False)
    console.print(document_table(rows, f"model {model}; {threads} threads, {machine['cpu']}. decode depth: the "
                                       f"tokens of a section, which its summary decodes after; decode tok/s: the "
                                       f"engine's tokens written over its summary and combine seconds, llama.cpp's "
                                       f"llama-bench at that depth; seconds and CPU s: a document's extraction and "
                                       f"processing (llama.cpp: its llama-completion calls, loads included)."))
    stem = out_folder / results_stem(machine, model)
    shown = {**settings.__dict__, "documents": [p.name for p in settings.documents],
             "peer": str(settings.peer) if settings.peer else None}
    write_json(stem.with_suffix(".json"), machine, shown, rows)  # makes the folder
    stem.with_suffix(".txt").write_text(console.export_text())
    err_console.print(f"wrote {stem}.txt")
