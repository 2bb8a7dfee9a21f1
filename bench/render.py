"""How `npumoed bench` shows its results: the tables on stdout, one progress line per result on stderr."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import click
from rich.console import Console
from rich.table import Column, Table

err_console = Console(stderr=True)


def wide_console() -> Console:
    """Wide enough for the tables when the output is a file or a pipe (a terminal sets its own width)."""
    return Console(width=None if sys.stdout.isatty() else 230)


def print_fidelity(results: Sequence[dict], caption: str) -> None:
    table = Table("capacity scale", "overflow", "tiers", "dropped", "spilled", "padding", "top-1 agreement",
                  "mean KL", "tokens/s", caption=caption, caption_justify="left")
    for row in results:
        table.add_row(_ratio(row.get("capacity_scale")), row.get("overflow", "exact model"),
                      " ".join(map(str, row.get("tiers", []))), _percent(row.get("dropped_fraction")),
                      _percent(row.get("spilled_fraction")), _percent(row.get("padding_fraction")),
                      f"{row['top1_agreement']:.1%}", _error(row["mean_kl"]), _number(row["tokens_per_s"]))
    wide_console().print(table)


def print_results(results: Sequence[dict], case_keys: Sequence[str], caption: str, machine: dict | None = None, *,
                  baseline: str | None = None) -> None:
    """One table per case (the values of `case_keys`), the engine's best exact path, what did another's work, and
    why any implementation was skipped or refused; a warning line above each table when the run was overloaded."""
    from .fair.paired import best_engine_row, clearly_faster, ratio_range
    from .machine import load_warning
    from .paths import ENGINE_PATHS, QUANTIZED_PATHS

    console = wide_console()
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
    console = wide_console()
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


def print_progress(row: dict) -> None:
    if row["impl"] == "profile":
        return
    case = " ".join(str(row[key]) for key in ("geometry", "tokens", "dtype", "capacity_scale") if key in row)
    speed = f"{row['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in row else row["status"]
    err_console.print(f"{case} {row['impl']}: {speed}".strip(), style="dim", highlight=False)


def print_real_fidelity(rows: Sequence[dict], caption: str) -> None:
    from .fidelity.real_text import TARGETS

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
    wide_console().print(table)


def print_peer_fidelity(row: dict, caption: str) -> None:
    """The engine's perplexity on a GGUF file beside llama-perplexity's on the same tokens (fidelity/peer.py)."""
    gib = 2**30
    table = Table("engine", "weights", "perplexity", "ratio to llama.cpp", "load s", "peak RSS GiB",
                  title="Perplexity on the same file and tokens as llama.cpp's llama-perplexity", caption=caption,
                  caption_justify="left")
    table.add_row("npumoe", row["weights"], f"{row['engine_perplexity']:.4f}", f"{row['ratio']:.4f}",
                  f"{row['engine_load_s']:.1f}", f"{row['engine_peak_rss'] / gib:.2f}")
    peer = f"{row['llama_cpp_perplexity']:.4f} ± {row['llama_cpp_perplexity_error']:.4f}"
    load = "" if row["llama_cpp_load_s"] is None else f"{row['llama_cpp_load_s']:.1f}"
    table.add_row("llama.cpp", "as stored", peer, "1", load,
                  f"{row['llama_cpp_peak_rss'] / gib:.2f}")
    wide_console().print(table)


def print_weights_fidelity(rows: Sequence[dict], caption: str) -> None:
    table = Table("model", "output layer", "weights", "top-1 vs fp32", "mean KL vs fp32", "top-1 vs its float",
                  "mean KL vs its float", title="Weights format against the float model", caption=caption,
                  caption_justify="left")
    for row in rows:
        table.add_row(row["model"], row["head"], row["format"], _percent(row["top1_vs_fp32"]),
                      _error(row["kl_vs_fp32"]), f"{_percent(row['top1_vs_float'])} ({row['vs_float']})",
                      _error(row["kl_vs_float"]))
    wide_console().print(table)


def print_layer_errors(layer_rows: Sequence[dict]) -> None:
    from .fidelity.weights import TARGETS

    layers = Table("geometry", "weights and activations", "format", "relative error", "weights alone", "target",
                   title="One MoE layer, quantized experts against fp32",
                   caption="weights alone: the format's floor, its rounded weights with exact fp32 activations",
                   caption_justify="left")
    for row in layer_rows:
        layers.add_row(row["geometry"], row["distribution"], row["format"], f"{row['rel_error']:.2%}",
                       f"{row['weights_alone_error']:.2%}", f"≤ {TARGETS[row['format']]:.0%}")
    wide_console().print(layers)


def print_memory(results: Sequence[dict], caption: str) -> None:
    gib = 2**30
    table = Table("stored", "weights", "kernel", "weights GiB", "experts GiB", "rest GiB", "before GiB", "loaded GiB",
                  "load peak GiB", "peak GiB", "peak − before GiB", "× weights", caption=caption,
                  caption_justify="left")
    for row in results:
        table.add_row(row["stored"], row["weights"], row["kernel"], *(f"{row[key] / gib:.2f}" for key in (
            "weight_bytes", "expert_bytes", "other_bytes", "before_rss", "loaded_rss", "load_peak_rss", "peak_rss",
            "peak_over_before")), f"{row['ratio']:.2f}")
    wide_console().print(table)


def print_sections(results: Sequence[dict], caption: str) -> None:
    table = Table("section tokens", "sections", "reduce rounds", "generated", "prefill s", "summary s", "reduce s",
                  "total s", "prefill tok/s", "tok/s", "× longest", "document cos", "chunk cos mean", "chunk cos min",
                  caption=caption, caption_justify="left")
    for row in results:
        seconds = row["seconds"]
        length = f"{row['section_tokens'] or 'context'} ({row['section_length']})"
        table.add_row(f"{length}{' *' if row['chosen'] else ''}", str(row["sections"]), str(row["reduce_rounds"]),
                      str(row["generated_tokens"]), *(f"{seconds[key]:.1f}" for key in ("prefill", "summary",
                                                                                        "reduce", "total")),
                      _number(row["prefill_tokens_per_s"]), _number(row["tokens_per_s"]), _ratio(row["speedup"]),
                      f"{row['document_cosine']:.4f}", f"{row['chunk_cosine_mean']:.4f}",
                      f"{row['chunk_cosine_min']:.4f}")
    wide_console().print(table)


def print_claim_runs(runs: dict[str, list], title: str) -> None:
    """`bench queue`: a line per queue and round, then each queue's median and its duplicates and losses."""
    import statistics

    table = Table("queue", "round", "jobs/s", "seconds", "duplicates", "lost", title=title)
    for name, done in runs.items():
        for i, run in enumerate(done, 1):
            table.add_row(name, str(i), f"{run.jobs_per_second:,.0f}", f"{run.seconds:.2f}", str(run.duplicates),
                          str(run.lost))
    Console().print(table)
    for name, done in runs.items():
        click.echo(f"{name}: median {statistics.median(r.jobs_per_second for r in done):,.0f} jobs/s; "
                   f"duplicates {sum(r.duplicates for r in done)}, lost {sum(r.lost for r in done)}")


def print_search(results: Sequence, k: int, title: str) -> None:
    table = Table("dim", "chunks", "fill s", "MB", f"median ms (k={k})", "p95 ms", title=title)
    for r in results:
        table.add_row(str(r.dim), f"{r.documents * r.chunks_per_document:,}", f"{r.fill_seconds:.1f}",
                      f"{r.database_mb:,.0f}", f"{r.median_ms:.1f}", f"{r.p95_ms:.1f}")
    Console().print(table)


def print_retrieval(results: Sequence, title: str) -> None:
    table = Table("vectors", "cosine/words/phrase", "passage R@1", "passage MRR", "document R@1", "document R@3",
                  "document MRR", title=title)
    for r in results:
        w = r.weights
        table.add_row(r.vectors, f"{w.cosine:.2f}/{w.words:.3f}/{w.phrase:.3f}", f"{r.passage_recall_at_1:.3f}",
                      f"{r.passage_mrr:.3f}", f"{r.document_recall_at_1:.3f}", f"{r.document_recall_at_3:.3f}",
                      f"{r.document_mrr:.3f}")
    Console().print(table)
    click.echo(f"chance: passage R@1 {results[0].passage_chance:.3f}, document R@1 {results[0].document_chance:.3f}")
