"""`npumoed model list`: the GGUF models already on this machine (Ollama's, LM Studio's, the Hugging Face cache's),
with the name to put in `[model] name` and whether the engine runs each here."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click

from .weights import gib

if TYPE_CHECKING:
    from npumoe.engine.loading.model_stores import StoredModel


@click.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the models as JSON.")
def list_command(as_json: bool) -> None:
    """The GGUF models in Ollama's store, LM Studio's folder and the Hugging Face cache: each one's name for
    `[model] name` (or any command that takes a model), size, and the weight formats that fit this machine. The
    stores are only read; a model runs from where it lies."""
    import psutil

    from npumoe.engine.loading.model_size import usable_bytes
    from npumoe.engine.loading.model_stores import find_models

    found = find_models()
    usable = usable_bytes(psutil.virtual_memory().total)
    rows = [_row(model, usable) for model in found.models]
    if as_json:
        click.echo(json.dumps({"models": rows, "searched": [str(p) for p in found.searched],
                               "unreadable": found.unreadable, "usable_bytes": usable}, indent=2))
        return
    for place in found.unreadable:
        click.echo(f"could not read {place}")
    if not rows:
        click.echo("No GGUF models found. Looked in: " + ", ".join(str(p) for p in found.searched))
        return
    # each name on a line of its own, never wrapped: it is what a person copies into the config
    for row in rows:
        click.echo(row["name"])
        click.echo(f"    {' · '.join(_facts(row))}")
    click.echo(f"\nfits here: the formats whose needs stay within the {gib(usable)} this machine leaves "
               "(`npumoed model size NAME` shows each).")


def _facts(row: dict[str, Any]) -> list[str]:
    facts = [row["store"]]
    if row["architecture"]:
        facts += [row["architecture"], row["quantization"], _count(row["parameters"]),
                  f"{gib(row['disk_bytes'])} on disk"]
    facts.append("runs" if row["runs"] else f"does not run: {row['problem']}")
    if row["fits"]:
        facts.append(f"fits here in {', '.join(row['fits'])}")
    return facts


def _row(model: StoredModel, usable: int) -> dict[str, Any]:
    """A model as `model list` shows it; what keeps it from running, in `problem`."""
    from npumoe.engine.loading.gguf_summary import HEADER_ERRORS, not_runnable, summarize
    from npumoe.engine.loading.model_size import SIZE_FORMATS, needed_bytes
    from npumoe.engine.loading.model_stores import split_reason

    row: dict[str, Any] = {"name": model.name, "store": model.store, "files": [str(p) for p in model.files],
                           "architecture": None, "quantization": None, "parameters": None, "disk_bytes": None,
                           "fits": [], "runs": False, "problem": model.problem}
    if model.problem:
        return row
    try:
        summary = summarize(model.files)
    except HEADER_ERRORS as e:
        return {**row, "problem": f"its GGUF header cannot be read (damaged, or not a GGUF file): {e}"}
    problem = split_reason(model) if model.split else not_runnable(summary)
    fits = [f for f in SIZE_FORMATS if needed_bytes(summary.size.formats[f].total_bytes) <= usable]
    return {**row, "architecture": summary.architecture, "quantization": summary.quantization,
            "parameters": summary.size.parameters, "disk_bytes": summary.disk_bytes, "fits": fits,
            "runs": problem is None, "problem": problem}


def _count(parameters: int) -> str:
    return f"{parameters / 1e9:.3g} B parameters" if parameters >= 1e9 else f"{parameters / 1e6:.3g} M parameters"
