"""`npumoed model quantize` and `npumoed model size`: a model's experts quantized once into the home, and what each
weight format needs in memory."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from .model_ref import model_ref

FORMATS = ("int8", "int4")  # listed here rather than imported, so that `npumoed --help` does not import torch


@click.command("quantize")
@click.argument("model_name", metavar="MODEL")
@click.option("--weights", "format", type=click.Choice(FORMATS), required=True, help="Format of the experts.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Folder to write (default: the home's models/quantized/).")
@click.option("--json", "as_json", is_flag=True, help="Print what was written as JSON.")
def quantize_command(model_name: str, format: str, out: Path | None, as_json: bool) -> None:
    """Quantize MODEL's routed experts (a checkpoint's, or a GGUF file's, one expert at a time), one tensor at a
    time, into the home (the rest stays in MODEL)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from npumoe.engine.errors import ModelError
    from npumoe.engine.loading.gguf_load import is_gguf
    from npumoe.engine.loading.gguf_quantize import quantize_gguf
    from npumoe.engine.loading.quant_store import QuantizedStoreError, quantize_checkpoint, quantized_folder
    from npumoe.engine.loading.resolve import fingerprint, model_folder

    from ..home import Home
    try:
        checkpoint, _ = model_folder(model_ref(model_name), allow_download=False, trust_remote_code=False)
        target = out or quantized_folder(Home.current().ensure().models, checkpoint, fingerprint(checkpoint), format)
        columns = (TextColumn(f"quantizing to {format}"), BarColumn(), MofNCompleteColumn(), TextColumn("tensors"),
                   TimeElapsedColumn())
        with Progress(*columns, console=Console(stderr=True)) as progress:
            task = progress.add_task("quantize", total=None)
            write = quantize_gguf if is_gguf(checkpoint) else quantize_checkpoint
            report = write(checkpoint, target, format,
                           progress=lambda done, total: progress.update(task, completed=done, total=total))
    except (ModelError, QuantizedStoreError) as e:
        raise click.ClickException(str(e)) from e
    if as_json:
        click.echo(json.dumps({"model": str(checkpoint), "format": format, "target": str(report.target),
                               "experts": report.experts, "kept": report.kept, "source_bytes": report.source_bytes,
                               "quantized_bytes": report.quantized_bytes}, indent=2))
        return
    click.echo(f"quantized {report.experts} expert weights of {checkpoint} to {format}: "
               f"{gib(report.source_bytes)} -> {gib(report.quantized_bytes)}; {report.kept} other tensors stay "
               f"in the checkpoint; wrote {report.target}")


@click.command("size")
@click.argument("model_name", metavar="MODEL")
@click.option("--json", "as_json", is_flag=True, help="Print the sizes as JSON.")
def size_command(model_name: str, as_json: bool) -> None:
    """What MODEL (a checkpoint folder, a .gguf file, a Hugging Face id in the local cache, "demo", or a
    config.json) needs in memory in each weight format, and which formats fit this machine; no weight is read."""
    import psutil

    from npumoe.engine.loading.model_size import (
        SIZE_FORMATS,
        checkpoint_tensors,
        config_tensors,
        model_size,
        needed_bytes,
        usable_bytes,
    )

    path = Path(model_name).expanduser()
    try:
        if path.is_file() and path.suffix != ".gguf":  # a config.json; a GGUF file is counted from its header
            tensors = config_tensors(json.loads(path.read_text()))
            counted = "from its config (built on the meta device)"
        else:
            from npumoe.engine.errors import ModelError
            from npumoe.engine.loading.resolve import model_folder

            try:
                checkpoint, _ = model_folder(model_ref(model_name), allow_download=False, trust_remote_code=False)
            except ModelError as e:
                raise click.ClickException(str(e)) from e
            tensors = checkpoint_tensors(checkpoint)
            counted = "from its GGUF header" if checkpoint.is_file() else "from its safetensors headers"
    except (OSError, ValueError, KeyError) as e:
        raise click.ClickException(f"{model_name}: {e}") from e
    size = model_size(tensors)
    usable = usable_bytes(psutil.virtual_memory().total)
    rows = [{"format": f, "expert_bytes": s.expert_bytes, "other_bytes": s.other_bytes, "weight_bytes": s.total_bytes,
             "needed_bytes": needed_bytes(s.total_bytes), "fits": needed_bytes(s.total_bytes) <= usable}
            for f, s in ((f, size.formats[f]) for f in SIZE_FORMATS)]
    if as_json:
        click.echo(json.dumps({"model": model_name, "parameters": size.parameters,
                               "expert_parameters": size.expert_parameters, "usable_bytes": usable,
                               "formats": rows}, indent=2))
        return
    console = Console()
    console.print(f"[bold]{model_name}[/]: {size.parameters / 1e9:.3g} B parameters, "
                  f"{size.expert_parameters / 1e9:.3g} B in routed experts, counted {counted}")
    table = Table("weights", "experts", "other", "all weights", "needs", "fits here")
    for row in rows:
        table.add_row(row["format"], gib(row["expert_bytes"]), gib(row["other_bytes"]), gib(row["weight_bytes"]),
                      gib(row["needed_bytes"]), "yes" if row["fits"] else "no")
    console.print(table)
    console.print(f"int8/int4: experts quantized, the rest bf16. Needs: 1.15 x the weights + 0.5 GiB for the "
                  f"process; this machine leaves {gib(usable)} (its RAM less a quarter, at least 2 GiB, for the "
                  "system and other programs).")


def gib(count: int) -> str:
    """Bytes in GiB, or MiB below one GiB."""
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"
