"""What the `npumoed bench` commands share: their common options, reading --geometry and --dtype, and the JSON
results file."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Sequence
from pathlib import Path

import click

from npumoe.engine.vocabulary import AUTO, DTYPE_ALIASES, DTYPES, WEIGHTS_DTYPE, dtype_name

from .render import err_console

# Every spelling of a dtype the options take; what reaches the benchmarks and their results is the vocabulary's own.
# auto: the float dtype `weights = auto` runs each geometry's experts in here (the fastest measured).
DTYPE_SPELLINGS = (AUTO, *DTYPES, *DTYPE_ALIASES)

MIN_SECONDS = 30.0  # the timed rounds of a case add up to at least this by default (bench moe, bench prefill)


def threads_option(f):
    return click.option("--threads", type=click.IntRange(min=1), default=os.cpu_count(), show_default=True,
                        help="torch threads (default: all cores).")(f)


def timing_options(f):
    f = click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True,
                     help="Timed runs per implementation; the median is reported.")(f)
    f = click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True,
                     help="Untimed runs before timing.")(f)
    return click.option("--seed", type=int, default=0, show_default=True, help="Seed for weights and inputs.")(f)


def rounds_options(f):
    f = click.option("--min-seconds", type=click.FloatRange(min=0), default=MIN_SECONDS, show_default=True,
                     help="Time more rounds than --repeats (up to 50) until the timed ones add up to this: a short "
                          "case gets the rounds its ratio ranges need.")(f)
    return click.option("--own-process/--no-own-process", default=True, show_default=True,
                        help="Also time transformers in a Python process of its own, under torch's OpenMP defaults "
                             "(no OMP_WAIT_POLICY, none of npumoed's settings), in the same rounds.")(f)


def dtype_option(help_text: str):
    return click.option("--dtype", "dtypes", multiple=True, type=click.Choice(DTYPE_SPELLINGS), default=(AUTO,),
                        show_default=True, help=help_text + " auto: the fastest float dtype measured here.",
                        callback=lambda _ctx, _param, values: tuple(dtype_name(v) for v in values))


def json_option(f):
    return click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
                        help="Also write the machine description and every result row to this JSON file.")(f)


def cuda_option(f):
    return click.option("--cuda", is_flag=True,
                        help="Run the rows on an NVIDIA GPU instead (bench/gpu/rows.py): the engine's cuda backend "
                             "(its groups as CUDA graphs), the same groups and one expert a group without graphs, "
                             "transformers' experts on the GPU.")(f)


def parse_geometries(names: Sequence[str]) -> list:
    from npumoe.engine.synthetic.geometry import parse_geometry

    try:
        return [parse_geometry(name) for name in names]
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--geometry") from e


def measured_dtypes(dtypes: Sequence[str], geometries: Sequence) -> tuple[str, ...]:
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


def require_matplotlib() -> None:
    """--plot draws with matplotlib, an optional extra: say so before a run of minutes, not after it."""
    if importlib.util.find_spec("matplotlib") is None:
        raise click.ClickException("--plot needs matplotlib, which is not installed: pip install 'npumoed[plot]'")


def write_json(path: Path | None, machine: dict, settings: dict, results: list[dict]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine, "settings": settings, "results": results}, indent=1) + "\n")
    err_console.print(f"wrote {path}")


