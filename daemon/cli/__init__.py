"""The `npumoed` command: queue and config commands here; each other area adds its own module."""

from __future__ import annotations

import importlib
import json
from datetime import datetime
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from npumoe.daemon.cli.app import App, emit_json, pass_app
from npumoe.daemon.intake import enqueue, iter_documents
from npumoe.jobs.queue import Job
from npumoe.jobs.schema import STATES

# Commands of the other areas, imported only when named: `npumoed status` must answer fast, and most
# areas pull in torch, coremltools or the engine.
AREA_COMMANDS = {
    "run": "run:run", "status": "run:status", "demo": "run:demo",
    "install": "service:install", "uninstall": "service:uninstall", "pause": "service:pause",
    "resume": "service:resume", "batch": "service:batch", "doctor": "service:doctor",
    "model": "engine:model_group", "calibrate": "engine:calibrate_command", "plan": "engine:plan_group",
    "compile": "coreml:compile_command",
    "bench": "npumoe.bench.cli:bench",  # the benchmarks live apart from the product; this is their only door
}


class AreaGroup(click.Group):
    """The root group: its own commands, plus each area's, loaded from their modules on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *AREA_COMMANDS})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in AREA_COMMANDS:
            return super().get_command(ctx, name)
        module, attr = AREA_COMMANDS[name].split(":")
        return getattr(importlib.import_module(module if "." in module else f"{__name__}.{module}"), attr)


@click.group(cls=AreaGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=click.Path(path_type=Path, dir_okay=False),
              help="Config file (default: config.toml in the home, when it exists).")
@click.version_option(package_name="npumoed")
@click.pass_context
def main(ctx: click.Context, config_path: Path | None) -> None:
    """npumoed: turn a folder of long documents into summaries and embeddings, in the background.

    All state lives in one home folder (NPUMOED_HOME, or the platform's data folder).
    """
    app = ctx.obj = ctx.obj or App(config_path)
    app.config_path = config_path
    ctx.call_on_close(app.close)


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the jobs as JSON.")
@pass_app
def add(app: App, paths: tuple[Path, ...], as_json: bool) -> None:
    """Queue documents (files, or folders searched recursively)."""
    results, problems = [], []
    for path in iter_documents(paths, recursive=app.config.inbox.recursive):
        try:
            job, created = enqueue(app.queue, path, app.config)
        except (OSError, ValueError) as e:
            problems.append(f"{path}: {e}")
            continue
        results.append({**job.as_dict(), "created": created})
        if not as_json:
            verb = "queued" if created else f"already known ({job.state})"
            click.echo(f"#{job.id} {verb}: {path}")
    if as_json:
        emit_json({"jobs": results, "errors": problems})
    for problem in problems:
        click.echo(f"npumoed: skipped {problem}", err=True)
    if problems and not results:
        raise SystemExit(1)


@main.command("jobs")
@click.option("--state", type=click.Choice(STATES), help="Only jobs in this state.")
@click.option("--limit", type=click.IntRange(min=1), help="At most this many jobs.")
@click.option("--json", "as_json", is_flag=True, help="Print {\"jobs\": [...]} as JSON.")
@pass_app
def list_jobs(app: App, state: str | None, limit: int | None, as_json: bool) -> None:
    """List jobs, oldest first."""
    found = app.queue.list(state, limit)
    if as_json:
        emit_json({"jobs": [job.as_dict() for job in found]})
        return
    table = Table("id", "state", "tries", "progress", "updated", "document", "last error", box=None)
    for job in found:
        table.add_row(str(job.id), job.state, f"{job.attempts}/{job.max_attempts}", f"{job.progress:.0%}",
                      datetime.fromtimestamp(job.updated_at).strftime("%m-%d %H:%M"), job.path,
                      job.last_error or "")
    Console().print(table if found else "no jobs")


def _change(app: App, job_id: int, action: str) -> Job:
    try:
        return getattr(app.queue, action)(job_id)
    except KeyError as e:
        raise click.ClickException(str(e.args[0])) from e
    except ValueError as e:
        raise click.ClickException(str(e)) from e


@main.command()
@click.argument("job_id", type=int)
@pass_app
def retry(app: App, job_id: int) -> None:
    """Queue a failed, dead or cancelled job again."""
    job = _change(app, job_id, "retry")
    click.echo(f"#{job.id} queued again: {job.path}")


@main.command()
@click.argument("job_id", type=int)
@pass_app
def cancel(app: App, job_id: int) -> None:
    """Cancel a queued or running job."""
    job = _change(app, job_id, "cancel")
    click.echo(f"#{job.id} cancelled: {job.path}")


@main.group()
def config() -> None:
    """Inspect the configuration."""


@config.command("show")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@pass_app
def config_show(app: App, as_json: bool) -> None:
    """Print the effective config (file values over defaults) as TOML."""
    effective = app.config.as_dict()
    if as_json:
        emit_json(effective)
        return
    for section, values in effective.items():
        click.echo(f"[{section}]")
        for key, value in values.items():
            click.echo(f"{key} = {_toml(value)}")
        click.echo()


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(value)  # JSON strings and numbers are valid TOML

