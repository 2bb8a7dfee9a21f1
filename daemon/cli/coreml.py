"""`npumoed compile`: convert a plan's group graphs into Core ML packages for the Neural Engine.

Builds go to the home's compiled/ folder, keyed by model, plan, coremltools version and weights format
(fp16, or int8 / int4 compressed by coremltools for `[model] weights = int8 | int4`); an existing
finished build is kept unless --force, and two processes building one wait for each other rather than
both writing it. Every group calibration saw load for is converted (at the Neural Engine's capacity
multiple, scaled where fp16 needs it): which of them pay on the accelerator is measured on the Mac.
Conversion runs on any platform; only running the packages needs macOS. `npumoed prepare` uses `build`.
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

from npumoe.engine.backends.coreml.compress import FP16, PACKAGE_FORMATS, package_format
from npumoe.engine.vocabulary import AUTO, COREML

from ..model_choice import ModelNotFound, resolve_model
from .app import App, emit_json, pass_app

if TYPE_CHECKING:
    from npumoe.engine.backends.coreml.cache import Manifest
    from npumoe.engine.moe.experts_layout import ExpertsLayout, ExpertWeights
    from npumoe.engine.plan.expert_plan import ExpertPlan

MAX_PACKAGE_MB = 1024


class Source(NamedTuple):
    """What a build converts: the plan, each plan layer's expert weights, their experts layout, the model key."""

    plan: ExpertPlan
    weights: Callable[[int], ExpertWeights]
    layout: ExpertsLayout
    model_key: str


@click.command("compile")
@click.option("--model", "model_name",
              help="Model: \"demo\", a checkpoint folder, a .gguf file or a Hugging Face id (with --plan).")
@click.option("--plan", "plan_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The ExpertPlan whose groups to convert (calibrated for this model).")
@click.option("--geometry", help="Sizing run instead: random weights at a named MoE geometry, e.g. qwen3-30b-a3b.")
@click.option("--layers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Sizing run: how many random layers.")
@click.option("--group-size", type=click.IntRange(min=1), default=8, show_default=True,
              help="Sizing run: experts per group graph.")
@click.option("--weights", "weights_format", type=click.Choice(PACKAGE_FORMATS),
              help="How the packages store expert weights: fp16, or int8 (per channel) / int4 (blocks of 32) "
                   "[default: the format of [model] weights: int8 or int4 as set, fp16 for the float formats and "
                   "auto].")
@click.option("--max-package-mb", type=click.IntRange(min=1), default=MAX_PACKAGE_MB, show_default=True,
              help="Start a new package before one would pass this many MiB of weights.")
@click.option("--force", is_flag=True, help="Rebuild even when a finished build exists.")
@click.option("--json", "as_json", is_flag=True, help="Print the build's summary as JSON.")
@pass_app
def compile_command(app: App, model_name: str | None, plan_path: Path | None, geometry: str | None, layers: int,
                    group_size: int, weights_format: str | None, max_package_mb: int, force: bool,
                    as_json: bool) -> None:
    """Convert group graphs to Core ML packages for the Neural Engine (fp16 compute, multifunction)."""
    if (geometry and (model_name or plan_path)) or (not geometry and not (model_name and plan_path)):
        raise click.UsageError("give either --model and --plan, or --geometry for a random-weight sizing run")
    source = _sizing(geometry, layers, group_size) if geometry else _checkpoint(app, model_name, plan_path)
    if weights_format is None:
        configured = app.config.model
        weights_format = package_format(configured.weights) if geometry else package_weights(
            resolve_model(model_name), configured.weights, trust_remote_code=configured.trust_remote_code)
    started = time.perf_counter()
    folder, manifest, reused = build(app.home.compiled, source.plan, source.model_key, lambda: source,
                                     every_group=bool(geometry), force=force, max_package_bytes=max_package_mb << 20,
                                     weights_format=weights_format)
    report(folder, manifest, reused, time.perf_counter() - started, as_json)


def package_weights(ref: str, weights: str | None, *, trust_remote_code: bool = False) -> str:
    """The package format of a model run with `[model] weights = weights`; `auto` stands for the format the engine
    will choose for it at load (a quantized GGUF file's int8 or int4, say), whose packages its backend looks for."""
    if weights == AUTO:
        from npumoe.engine.errors import ModelError
        from npumoe.engine.loading.auto_weights import choose_model_weights

        try:
            weights = choose_model_weights(ref, trust_remote_code=trust_remote_code)[1].weights
        except ModelError as e:
            raise click.ClickException(str(e)) from e
    return package_format(weights)


def build(root: Path, plan: ExpertPlan, model_key: str, load: Callable[[], Source], *, every_group: bool = False,
          force: bool = False, max_package_bytes: int = MAX_PACKAGE_MB << 20,
          weights_format: str = FP16) -> tuple[Path, Manifest, bool]:
    """(build folder, manifest, whether it was built already) for the Core ML graphs of `plan`, their weights
    stored in `weights_format`: every group calibration saw load for (residency on a Mac picks among them), or
    with `every_group` all of them. `load` gives the weights, called only when there is something to convert."""
    from npumoe.engine.backends.coreml.cache import build_folder, build_once
    from npumoe.engine.backends.coreml.convert import ConversionError, build_packages, plan_digest, plan_group_graphs
    from npumoe.engine.backends.coreml.env import coremltools_version
    from npumoe.engine.backends.registry import backend_class
    from npumoe.engine.plan.residency import decide_residency

    groups = plan_group_graphs(plan, decide_residency(plan, backend_class(COREML)), every_group=every_group)
    if not groups:
        raise click.ClickException("calibration saw no load for any group of the plan: there is nothing to convert")
    digest = plan_digest(plan, groups)
    folder = build_folder(root, model_key, digest, coremltools_version(), weights_format)

    def convert() -> Manifest:
        source = load()
        with Progress(TextColumn("converting {task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=Console(stderr=True)) as progress:
            task = progress.add_task("group graphs", total=len(groups))
            try:
                return build_packages(
                    groups, source.weights, source.layout, folder, model=model_key, digest=digest,
                    weights_format=weights_format, max_package_bytes=max_package_bytes,
                    on_converted=lambda g: progress.update(task, advance=1, description=g.function))
            except ConversionError as e:
                raise click.ClickException(str(e)) from e

    manifest, reused = build_once(folder, convert, force=force)
    return folder, manifest, reused


def report(folder: Path, manifest: Manifest, reused: bool, seconds: float, as_json: bool) -> None:
    """What a build holds: functions, packages and bytes, as a table or JSON."""
    total = sum(manifest.package_bytes.values())
    summary = {"folder": str(folder), "reused": reused, "seconds": round(seconds, 1),
               "functions": len(manifest.groups), "package_count": len(manifest.package_bytes), "bytes": total,
               "weights": manifest.weights, "packages": manifest.package_bytes}
    if as_json:
        emit_json(summary)
        return
    table = Table("package", "functions", "MiB", box=None)
    for package, size in sorted(manifest.package_bytes.items()):
        table.add_row(package, str(sum(g.package == package for g in manifest.groups)), f"{size / 2**20:.1f}")
    console = Console()
    console.print(table)
    verb = "already built" if reused else f"built in {seconds:.1f} s"
    console.print(f"{len(manifest.groups)} functions in {len(manifest.package_bytes)} packages of "
                  f"{manifest.weights} weights, {total / 2**20:.1f} MiB, {verb}: {escape(str(folder))}")


def _checkpoint(app: App, model_name: str, plan_path: Path) -> Source:
    """A real checkpoint and its plan."""
    from npumoe.engine.errors import ModelError
    from npumoe.engine.loading.load import load_model
    from npumoe.engine.moe.experts_layout import expert_weights
    from npumoe.engine.moe.model_experts import moe_layouts
    from npumoe.engine.plan.expert_plan import ExpertPlan, PlanError

    try:
        plan = ExpertPlan.load(plan_path)
        loaded = load_model(resolve_model(model_name),
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
    from npumoe.engine.synthetic.coreml_sizing import sizing_model
    from npumoe.engine.synthetic.geometry import parse_geometry

    try:
        sizing = sizing_model(parse_geometry(geometry), layers=layers, group_size=group_size)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--geometry") from e
    return Source(sizing.plan, sizing.weights.__getitem__, sizing.layout, sizing.plan.model_key)
