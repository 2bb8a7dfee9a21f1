"""`npumoed bench make-target`: the target model at its full size, as a GGUF file of random blocks, kept in a cache.

    npumoed bench make-target [--type q4_0|q8_0] [--geometry qwen3-30b-a3b] [--layers N] [--out FILE]

Qwen3-30B-A3B's real geometry (48 layers, 128 experts, top-8, its attention and vocabulary) written by
engine/synthetic/random_gguf.py: about 17 GB in Q4_0, 32 GB in Q8_0, block by block, so the writer's memory stays
small whatever the size. The vocabulary is the demo model's tokenizer padded with unused tokens to the geometry's
151,936, so that text goes in as it would (the engine and llama.cpp both tokenize it). Made on demand, never by the
test suite: the file is written under a temporary name and renamed, so the cache never holds half a file, and a made
target is kept. A Q4_K_M file (what Ollama ships) comes from the Q8_0 one through the peer build:
`llama-quantize --allow-requantize TARGET-q8_0.gguf OUT.gguf Q4_K_M`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from ..memory import peak_rss, rss
from ..render import err_console

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TARGET_GEOMETRY = "qwen3-30b-a3b"
TARGET_TYPES = ("q4_0", "q8_0")  # random_gguf.RANDOM_TYPES, named here so `--help` needs no torch



def target_path(geometry: str, type_name: str, layers: int | None = None) -> Path:
    """Where the target of this geometry, type and layer count is kept: the models cache (not the home)."""
    from npumoe.engine.synthetic.smollm2 import models_cache

    cut = f"-{layers}layers" if layers is not None else ""
    return models_cache() / "targets" / f"{geometry}{cut}-random-{type_name}.gguf"


def make_target(out: Path, geometry_name: str, type_name: str, tokenizer: PreTrainedTokenizerBase, *,
                layers: int | None = None, show_progress: bool = True) -> dict:
    """Write the target with `tokenizer` to `out` (through a temporary name in its folder) and say what it took:
    bytes, wall seconds, MB/s, this process's resident memory before writing and its peak."""
    from npumoe.engine.synthetic.geometry import parse_geometry
    from npumoe.engine.synthetic.random_gguf import RANDOM_TYPES, random_gguf_layout, write_random_gguf
    from npumoe.jobs.outputs import temporary_path

    config, tensors = random_gguf_layout(parse_geometry(geometry_name), RANDOM_TYPES[type_name], layers=layers)
    total = sum(tensor.nbytes for tensor in tensors)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = temporary_path(out.parent, out.name)
    before, started = rss(), time.perf_counter()  # the libraries and the tokenizer in memory, nothing written yet
    try:
        with Progress(TextColumn(f"writing {out.name}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                      TimeRemainingColumn(), console=err_console, disable=not show_progress) as progress:
            task = progress.add_task("write", total=total)
            write_random_gguf(partial, config, tensors, tokenizer,
                              progress=lambda written: progress.advance(task, written))
        partial.rename(out)
    finally:
        partial.unlink(missing_ok=True)
    seconds = time.perf_counter() - started
    size = out.stat().st_size
    return {"path": str(out), "geometry": geometry_name, "type": type_name, "layers": config.num_hidden_layers,
            "tensor_bytes": total, "file_bytes": size, "seconds": seconds, "mb_per_s": size / seconds / 1e6,
            "rss_before": before, "peak_rss": peak_rss()}


@click.command("make-target")
@click.option("--type", "type_name", type=click.Choice(TARGET_TYPES), default="q4_0", show_default=True,
              help="Block type of every 2-D weight (Q4_K_M: llama-quantize the q8_0 file, see --help's text).")
@click.option("--geometry", "geometry_name", default=TARGET_GEOMETRY, show_default=True,
              help="A model named in engine/synthetic/geometries.json.")
@click.option("--layers", type=click.IntRange(min=1), default=None,
              help="Only the first N decoder layers (default: all of them, the full model).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write here instead of the models cache.")
@click.option("--force", is_flag=True, help="Write it again even if the file exists.")
def make_target_command(type_name: str, geometry_name: str, layers: int | None, out: Path | None,
                        force: bool) -> None:
    """Write the target model at its real geometry as a GGUF file of random blocks (about 17 GB in Q4_0) and print
    its path; a target already made is kept."""
    out = out or target_path(geometry_name, type_name, layers)
    if out.exists() and not force:
        click.echo(out)
        err_console.print(f"already made: {out} ({out.stat().st_size / 1e9:.1f} GB); --force writes it again")
        return
    from transformers import AutoTokenizer

    from npumoe.daemon.model_choice import demo_model

    try:
        made = make_target(out, geometry_name, type_name, AutoTokenizer.from_pretrained(demo_model()), layers=layers)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    err_console.print(f"{made['layers']} layers, {made['file_bytes'] / 1e9:.2f} GB in {made['seconds']:.1f} s "
               f"({made['mb_per_s']:,.0f} MB/s), peak RSS {made['peak_rss'] / 2**20:,.0f} MiB "
               f"({made['rss_before'] / 2**20:,.0f} MiB before writing)", highlight=False)
    click.echo(out)
