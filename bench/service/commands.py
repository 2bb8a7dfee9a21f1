"""`npumoed bench` commands that measure the service around the engine: the queue's claims, search queries,
whole search commands, and retrieval on the written question set or the sample documents."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from npumoe.engine.vocabulary import POOLINGS

from ..options import json_option, write_json
from ..render import err_console, print_claim_runs, print_retrieval, print_search

if TYPE_CHECKING:
    from npumoe.engine import Engine


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
@click.option("--runs", type=click.IntRange(min=1), default=5, show_default=True, help="Timed searches.")
@click.option("--query", default=None, help="The query (default: the README's example).")
@json_option
def query_latency_bench(home: Path, runs: int, query: str | None, json_path: Path | None) -> None:
    """Whole `npumoed search` commands, each embedding its query with the search model."""
    from ..machine import describe_machine
    from .query_latency import QUERY, measure, summary_lines

    result = measure(home, runs, query or QUERY)
    for line in summary_lines(result):
        click.echo(line)
    write_json(json_path, describe_machine(1), {"home": str(home), "runs": runs}, [result])


@click.command("retrieval")
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
@json_option
def retrieval_bench(question_set: str, vector_kinds: tuple[str, ...], model_name: str | None,
                    poolings: tuple[str, ...], n_documents: int | None, threads: int | None,
                    json_path: Path | None) -> None:
    """Retrieval: recall@1, recall@3 and MRR of paraphrased questions, for each way of making vectors and each
    weighting of vectors against words."""
    import dataclasses

    import torch

    from npumoe.jobs.search.sentence_model import sentence_model

    from ..machine import describe_machine
    from .questions import QUESTIONS, written_set
    from .retrieval import EngineVectors, SearchModelVectors, compare, sample_texts

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
    print_retrieval(results, f"retrieval: {len(questions)} questions on {len(texts)} documents")
    write_json(json_path, describe_machine(torch.get_num_threads()), settings,
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
    err_console.print(f"measuring {engine.model_key}", style="dim")
    return engine
