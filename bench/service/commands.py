"""`npumoed bench` commands that measure the service around the engine: the queue's claims, search queries,
whole search commands, and retrieval on the sample documents."""

from __future__ import annotations

from pathlib import Path

import click

from npumoe.engine.vocabulary import POOLINGS

from ..options import json_option, write_json
from ..render import err_console, print_claim_runs, print_retrieval, print_search


@click.command("queue")
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
    from .queue import fresh_queue, run_claim_benchmark

    queues = {"sqlite": None, **({"postgresql": url} if url else {})}
    runs: dict[str, list] = {name: [] for name in queues}
    for _ in range(rounds):
        for name, server in queues.items():
            with fresh_queue(server) as location:
                runs[name].append(run_claim_benchmark(location, processes=processes, jobs=n_jobs))
    print_claim_runs(runs, f"{processes} processes × {n_jobs} jobs")


@click.command("search")
@click.option("--documents", type=click.IntRange(min=1), default=10_000, show_default=True,
              help="Documents in the index.")
@click.option("--chunks", type=click.IntRange(min=1), default=8, show_default=True, help="Chunks per document.")
@click.option("--dim", "dims", multiple=True, type=click.IntRange(min=1), default=(64, 2048), show_default=True,
              help="Vector width (repeatable); 64 is the demo model's.")
@click.option("-k", "k", type=click.IntRange(min=1), default=10, show_default=True, help="Chunks asked for.")
@click.option("--queries", type=click.IntRange(min=1), default=50, show_default=True, help="Timed queries.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for the vectors.")
@json_option
def search_bench(documents: int, chunks: int, dims: tuple[int, ...], k: int, queries: int, seed: int,
                 json_path: Path | None) -> None:
    """Search query latency on an index of random vectors (sqlite-vec, exact): median and p95 for k chunks."""
    import dataclasses
    import tempfile

    from ..machine import describe_machine
    from .search import run_search_benchmark

    results = []
    with tempfile.TemporaryDirectory() as folder:
        for dim in dims:
            err_console.print(f"filling {documents:,} documents × {chunks} chunks at {dim} dimensions", style="dim")
            results.append(run_search_benchmark(Path(folder), dim=dim, documents=documents, chunks=chunks, k=k,
                                                queries=queries, seed=seed))
    print_search(results, k, f"search: {documents:,} documents × {chunks} chunks, {queries} queries")
    write_json(json_path, describe_machine(1), {"documents": documents, "chunks": chunks, "k": k,
                                                 "queries": queries, "seed": seed},
               [dataclasses.asdict(r) for r in results])


@click.command("query-latency")
@click.option("--home", type=click.Path(file_okay=False, exists=True, path_type=Path), required=True,
              help="A home whose documents are processed and indexed (e.g. the demo's: make demo).")
@click.option("--runs", type=click.IntRange(min=1), default=5, show_default=True, help="Timed searches each way.")
@click.option("--query", default=None, help="The query (default: the README's example).")
@json_option
def query_latency_bench(home: Path, runs: int, query: str | None, json_path: Path | None) -> None:
    """Whole `npumoed search` commands without the daemon (they load the model) and with it running (they ask it)."""
    from ..machine import describe_machine
    from .query_latency import QUERY, measure, summary_lines

    result = measure(home, runs, query or QUERY)
    for line in summary_lines(result):
        click.echo(line)
    write_json(json_path, describe_machine(1), {"home": str(home), "runs": runs}, [result])


@click.command("retrieval")
@click.option("--model", "model_name",
              help="Model: \"demo\", a checkpoint folder or a Hugging Face id (default: the home config's).")
@click.option("--pooling", "poolings", multiple=True, type=click.Choice(POOLINGS), default=POOLINGS,
              show_default=True, help="How chunk vectors are made (repeatable).")
@click.option("--threads", type=click.IntRange(min=1), help="torch threads (default: leave as is).")
@json_option
def retrieval_bench(model_name: str | None, poolings: tuple[str, ...], threads: int | None,
                    json_path: Path | None) -> None:
    """Retrieval on the sample documents: recall@1 and MRR of paraphrased questions, for each pooling and each
    weighting of vectors against words."""
    import dataclasses

    import torch

    from npumoe.daemon.config import load_config
    from npumoe.daemon.home import Home
    from npumoe.daemon.model_choice import engine_settings, load_engine

    from ..machine import describe_machine
    from .retrieval import measure, sample_texts

    config = load_config(None)
    if model_name is not None:
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, name=model_name))
    engine = load_engine(engine_settings(config, Home.current().ensure(), threads=threads))
    err_console.print(f"measuring {engine.model_key}", style="dim")
    try:
        results = measure(engine, sample_texts(), poolings)
    finally:
        engine.close()
    print_retrieval(results, f"retrieval: {results[0].questions} questions on the samples, {engine.model_key}")
    write_json(json_path, describe_machine(torch.get_num_threads()), {
        "model": config.model.name, "model_key": engine.model_key, "chunk_tokens": engine.chunk_tokens,
        "poolings": list(poolings)}, [dataclasses.asdict(r) for r in results])
