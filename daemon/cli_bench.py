"""`npumoed bench`: the engine's benchmarks (MoE layer, whole-model prefill, pruning fidelity).

The lead wires it into `npumoed` with `main.add_command(bench)`. torch and transformers are imported
inside the commands, so `npumoed --help` stays fast. Each command prints a table and, with --json,
writes {"machine": ..., "settings": ..., "results": [...]} for the results folder.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import click
from rich.console import Console
from rich.table import Column, Table

DTYPE_NAMES = ("fp32", "bf16")

_err = Console(stderr=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def bench() -> None:
    """Benchmarks: print a table, optionally write JSON with the machine description."""


def _threads_option(f):
    return click.option("--threads", type=click.IntRange(min=1), default=os.cpu_count(), show_default=True,
                        help="torch threads (default: all cores).")(f)


def _timing_options(f):
    f = click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True,
                     help="Timed runs per implementation; the median is reported.")(f)
    f = click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True,
                     help="Untimed runs before timing.")(f)
    return click.option("--seed", type=int, default=0, show_default=True, help="Seed for weights and inputs.")(f)


def _json_option(f):
    return click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
                        help="Also write the machine description and every result row to this JSON file.")(f)


@bench.command("moe")
@click.option("--geometry", "geometries", multiple=True, default=("qwen3-30b-a3b",), show_default=True,
              help="MoE layer geometry (repeatable): qwen3-30b-a3b, phi-3.5-moe, phi-tiny-moe, olmoe-1b-7b, "
                   "or HIDDENxEXPERTSxTOPKxFFN.")
@click.option("--tokens", multiple=True, type=click.IntRange(min=1), default=(512,), show_default=True,
              help="Prefill chunk length in tokens (repeatable).")
@click.option("--dtype", "dtypes", multiple=True, type=click.Choice(DTYPE_NAMES), default=("bf16",),
              show_default=True, help="Weight and activation dtype (repeatable).")
@click.option("--skew", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="Zipf exponent of expert popularity in the generated routing (0: uniform).")
@click.option("--calibration-chunks", type=click.IntRange(min=1), default=8, show_default=True,
              help="Routing draws the engine's plan is calibrated on.")
@_threads_option
@_timing_options
@_json_option
def moe(geometries: tuple[str, ...], tokens: tuple[int, ...], dtypes: tuple[str, ...], skew: float,
        calibration_chunks: int, threads: int, warmup: int, repeats: int, seed: int, json_path: Path | None) -> None:
    """MoE-layer prefill throughput on random weights: transformers' experts vs the engine vs the roofline."""
    from npumoe.engine.moe_geometry import parse_geometry

    try:
        parsed = [parse_geometry(g) for g in geometries]
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--geometry") from e
    import torch

    from npumoe.engine.bench_moe import MoeBenchSettings, run_moe_bench
    from npumoe.engine.machine import describe_machine
    from npumoe.engine.roofline import MODEL

    torch.set_num_threads(threads)
    machine = describe_machine(threads)
    settings = MoeBenchSettings(threads=threads, warmup=warmup, repeats=repeats, seed=seed, skew=skew,
                                calibration_chunks=calibration_chunks)
    results = run_moe_bench(parsed, tokens, dtypes, settings, bandwidth=machine["copy_bandwidth_gbps"] * 1e9,
                            on_result=_progress)
    caption = (f"× transformers: against transformers' fastest implementation in the same case. {MODEL}. "
               f"{threads} threads, copy bandwidth {machine['copy_bandwidth_gbps']} GB/s, {machine['cpu']}; "
               f"routing Zipf skew {skew}.")
    print_results(results, ("geometry", "tokens", "dtype"), caption, baseline="roofline")
    _write_json(json_path, machine, {"warmup": warmup, "repeats": repeats, "seed": seed, "skew": skew,
                                     "calibration_chunks": calibration_chunks, "roofline_model": MODEL}, results)


def print_results(results: Sequence[dict], case_keys: Sequence[str], caption: str, *, baseline: str) -> None:
    """One table per case (the values of `case_keys`), then why any implementation was skipped or refused."""
    console = Console(width=None if sys.stdout.isatty() else 132)
    cases: dict[tuple, list[dict]] = {}
    for row in results:
        cases.setdefault(tuple(row[key] for key in case_keys), []).append(row)
    for case, rows in cases.items():
        console.print(results_table(rows, ", ".join(f"{key} {value}" for key, value in zip(case_keys, case,
                                                                                          strict=True)), baseline))
        for row in rows:
            if "error" in row:
                console.print(f"  {row['impl']} {row['status']}: {row['error']}", style="red", highlight=False)
    console.print(caption, style="dim", highlight=False)


def results_table(rows: Sequence[dict], title: str, baseline: str) -> Table:
    """One line per implementation: speed, ratios, what the engine did with the assignments, its error."""
    table = Table(Column("impl", no_wrap=True), "tokens/s", "× transformers", f"× {baseline}", "padding",
                  "spilled", "dropped", "rel. error", Column("note", no_wrap=True), title=title, title_justify="left")
    for row in rows:
        table.add_row(row["impl"], _number(row.get("tokens_per_s")), _ratio(row.get("vs_transformers_best")),
                      _ratio(row.get(f"vs_{baseline}")), _percent(row.get("padding_fraction")),
                      _percent(row.get("spilled_fraction")), _percent(row.get("dropped_fraction")),
                      _error(row.get("rel_error")), _note(row))
    return table


def _note(row: dict) -> str:
    if row["status"] in ("skipped", "refused"):
        return f"[red]{row['status']}[/red]"
    if row["status"] == "approximate":
        return "approximate: prunes"
    return f"{row['bound']}-bound" if "bound" in row else ""


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def _percent(value: float | None) -> str:
    return "" if value is None else f"{value:.1%}"


def _error(value: float | None) -> str:
    return "" if value is None else f"{value:.1e}"


def _progress(row: dict) -> None:
    speed = f"{row['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in row else row["status"]
    _err.print(f"[dim]{row.get('geometry', row.get('model', ''))} {row.get('tokens', '')} {row.get('dtype', '')} "
               f"{row['impl']}: {speed}[/dim]")


def _write_json(path: Path | None, machine: dict, settings: dict, results: list[dict]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine, "settings": settings, "results": results}, indent=1) + "\n")
    _err.print(f"wrote {path}")
