"""`npumoed compile`: convert a plan's group graphs into Core ML packages for the Neural Engine.

The lead wires it into `npumoed` with `main.add_command(compile_command)`. Builds go to the home's
compiled/ folder, keyed by model, plan and coremltools version; an existing finished build is kept
unless --force. Conversion runs on any platform; only running the packages needs macOS.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from npumoe.daemon.cli.app import App, emit_json, pass_app
from npumoe.daemon.models import ModelNotFound, resolve_model

if TYPE_CHECKING:
    from npumoe.engine.experts_layout import ExpertsLayout, ExpertWeights
    from npumoe.engine.plan import ExpertPlan


class Source(NamedTuple):
    """What a build converts: the plan, each plan layer's expert weights, their experts layout, the model key."""

    plan: ExpertPlan
    weights: Callable[[int], ExpertWeights]
    layout: ExpertsLayout
    model_key: str


@click.command("compile")
@click.option("--model", "model_name", help="Model: \"demo\", a checkpoint folder or a Hugging Face id (with --plan).")
@click.option("--plan", "plan_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The ExpertPlan whose accelerator groups to convert (made for this model).")
@click.option("--geometry", help="Sizing run instead: random weights at a named MoE geometry, e.g. qwen3-30b-a3b.")
@click.option("--layers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Sizing run: how many random layers.")
@click.option("--group-size", type=click.IntRange(min=1), default=8, show_default=True,
              help="Sizing run: experts per group graph.")
@click.option("--max-package-mb", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Start a new package before one would pass this many MiB of weights.")
@click.option("--force", is_flag=True, help="Rebuild even when a finished build exists.")
@click.option("--json", "as_json", is_flag=True, help="Print the build's summary as JSON.")
@pass_app
def compile_command(app: App, model_name: str | None, plan_path: Path | None, geometry: str | None, layers: int,
                    group_size: int, max_package_mb: int, force: bool, as_json: bool) -> None:
    """Convert group graphs to Core ML packages for the Neural Engine (fp16, multifunction)."""
    if (geometry and (model_name or plan_path)) or (not geometry and not (model_name and plan_path)):
        raise click.UsageError("give either --model and --plan, or --geometry for a random-weight sizing run")
    from npumoe.engine.coreml.cache import build_folder, read_manifest
    from npumoe.engine.coreml.convert import ConversionError, build_packages, plan_digest, plan_group_graphs
    from npumoe.engine.coreml.env import import_coremltools

    if geometry:
        source = _sizing(geometry, layers, group_size)
        groups = plan_group_graphs(source.plan, resident_only=False)  # sizing: as if every group were resident
    else:
        source = _checkpoint(app, model_name, plan_path)
        groups = plan_group_graphs(source.plan)
    if not groups:
        raise click.ClickException("the plan keeps every group on the CPU: there is nothing to convert")
    digest = plan_digest(source.plan, groups)
    folder = build_folder(app.home.compiled, source.model_key, digest, import_coremltools().__version__)
    manifest = None if force else read_manifest(folder)
    reused = manifest is not None
    started = time.perf_counter()
    if manifest is None:
        with Progress(TextColumn("converting {task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=Console(stderr=True)) as progress:
            task = progress.add_task("group graphs", total=len(groups))
            try:
                manifest = build_packages(
                    groups, source.weights, source.layout, folder, model=source.model_key, digest=digest,
                    max_package_bytes=max_package_mb << 20,
                    on_converted=lambda g: progress.update(task, advance=1, description=g.function))
            except ConversionError as e:
                raise click.ClickException(str(e)) from e
    seconds = time.perf_counter() - started
    summary = {"folder": str(folder), "reused": reused, "seconds": round(seconds, 1),
               "functions": len(manifest.groups), "packages": manifest.package_bytes}
    if as_json:
        emit_json(summary)
        return
    table = Table("package", "functions", "MiB", box=None)
    for package, size in sorted(manifest.package_bytes.items()):
        table.add_row(package, str(sum(g.package == package for g in manifest.groups)), f"{size / 2**20:.1f}")
    console = Console()
    console.print(table)
    verb = "already built" if reused else f"built in {seconds:.1f} s"
    console.print(f"{len(manifest.groups)} group graphs {verb}: {escape(str(folder))}")


def _checkpoint(app: App, model_name: str, plan_path: Path) -> Source:
    """A real checkpoint and its plan."""
    from npumoe.engine.experts_layout import expert_weights
    from npumoe.engine.models import ModelError, load_model, moe_layouts
    from npumoe.engine.plan import ExpertPlan, PlanError

    try:
        plan = ExpertPlan.load(plan_path)
        loaded = load_model(resolve_model(model_name, app.home.models),
                            trust_remote_code=app.config.model.trust_remote_code)
    except (ModelNotFound, ModelError, PlanError) as e:
        raise click.ClickException(str(e)) from e
    if plan.model_key.rpartition("@")[2] != loaded.key.rpartition("@")[2]:
        raise click.ClickException(f"{plan_path}: calibrated for {plan.model_key}, not for {loaded.key}")
    modules = {name: (module, layout) for name, module, layout in moe_layouts(loaded.model)}
    missing = [layer.name for layer in plan.layers if layer.name not in modules]
    if missing:
        raise click.ClickException(f"{plan_path}: the model has no MoE layer {missing[0]}")
    weights = [expert_weights(*modules[layer.name]) for layer in plan.layers]
    return Source(plan, weights.__getitem__, modules[plan.layers[0].name][1], loaded.key)


def _sizing(geometry: str, layers: int, group_size: int) -> Source:
    """Random-weight layers at a real geometry, and a plan for them."""
    from npumoe.engine.coreml.sizing import sizing_model
    from npumoe.engine.geometry import parse_geometry

    try:
        sizing = sizing_model(parse_geometry(geometry), layers=layers, group_size=group_size)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--geometry") from e
    return Source(sizing.plan, sizing.weights.__getitem__, sizing.layout, sizing.plan.model_key)
