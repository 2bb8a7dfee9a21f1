"""The `npumoed` command: queue and config commands here; each other area adds its own module."""

from __future__ import annotations

import importlib
import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from npumoe.jobs.queue.schema import STATES
from npumoe.jobs.queue.store import Job

from ..home import inbox_folders
from ..intake import Enqueued, content_now, enqueue_paths
from .app import App, emit_json, pass_app
from .terminal import printable

# Commands of the other areas, imported only when named: `npumoed status` must answer fast, and most
# areas pull in torch, coremltools or the engine.
AREA_COMMANDS = {
    "run": "run:run", "status": "run:status", "demo": "run:demo",
    "install": "service:install", "uninstall": "service:uninstall", "pause": "service:pause",
    "resume": "service:resume", "batch": "service:batch", "doctor": "service:doctor",
    "model": "engine:model_group", "calibrate": "engine:calibrate_command", "plan": "engine:plan_group",
    "compile": "coreml:compile_command", "prepare": "prepare:prepare_command",
    "search": "search:search", "similar": "search:similar", "reindex": "search:reindex_command",
    "bench": "npumoe.bench.cli:bench",  # the benchmarks live apart from the product; this is their only door
}


class AreaGroup(click.Group):
    """The root group: its own commands, plus each area's, loaded from their modules on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *AREA_COMMANDS})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in AREA_COMMANDS:
            return super().get_command(ctx, name)
        wait_passively()  # before the area's module, which may load torch and with it OpenMP
        module, attr = AREA_COMMANDS[name].split(":")
        return getattr(importlib.import_module(module if "." in module else f"{__name__}.{module}"), attr)


def wait_passively() -> None:
    """Have OpenMP's idle threads sleep rather than spin, unless the person chose otherwise (OMP_WAIT_POLICY).

    By default torch's OpenMP threads spin for a while after each parallel region, holding a core that the
    engine's own worker threads (and the person's programs) then wait for; the engine alternates between the two
    many times a layer. Waiting passively costs a wake-up per region and measured faster: whole-model prefill of
    a 2,048-token document on 2 cores rose 6 % (bf16) and 20 % (int8). OpenMP reads the setting when it loads, so
    it is set before any command that may load torch."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


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
    enqueued = enqueue_paths(app.queue, paths, app.config, on_job=None if as_json else echo_job)
    if as_json:
        emit_json({"jobs": job_dicts(enqueued), "errors": enqueued.problems})
    report_skipped(enqueued)


def echo_job(path: Path, job: Job, created: bool, *, queued: str = "queued") -> None:
    """A document's line as `add` and `batch` print it: `queued` when its job is new, else the job's state."""
    click.echo(f"#{job.id} {queued if created else f'already known ({job.state})'}: {printable(str(path))}")


def job_dicts(enqueued: Enqueued) -> list[dict[str, Any]]:
    """The queued jobs as `--json` prints them: each job's fields and whether it was created now."""
    return [{**job.as_dict(), "created": created} for job, created in enqueued.jobs]


def report_skipped(enqueued: Enqueued) -> None:
    """Name each path that could not be queued; exit 1 when that was every one."""
    for problem in enqueued.problems:
        click.echo(f"npumoed: skipped {printable(problem)}", err=True)
    if enqueued.failed:
        raise SystemExit(1)


FOLDER_CHARS = 20  # of a job's folder, `npumoed jobs` shows the end: the part nearest the file


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
    # The file name is what a person looks for, so it comes whole; of the folder, its nearest part. The host
    # column only where several machines share the queue.
    hosts = any(job.worker_host for job in found)
    table = Table(box=None)
    for name in ("id", "state", *(["host"] if hosts else []), "tries", "progress", "updated", "document"):
        table.add_column(name, no_wrap=True)
    table.add_column("last error", overflow="fold", min_width=10)
    table.add_column("in folder", no_wrap=True)
    for job in found:  # names and errors as Text: rich would read `[draft]` in a file name as markup
        path = Path(job.path)
        table.add_row(str(job.id), job.state, *([Text(printable(job.worker_host or ""))] if hosts else []),
                      f"{job.attempts}/{job.max_attempts}", f"{job.progress:.0%}",
                      datetime.fromtimestamp(job.updated_at).strftime("%m-%d %H:%M"),
                      Text(printable(path.name)), Text(printable(job.last_error or "")),
                      Text(printable(_tail(str(path.parent), FOLDER_CHARS))))
    Console().print(table if found else "no jobs")


def _tail(text: str, most: int) -> str:
    """`text`, or its last `most` characters after an ellipsis."""
    return text if len(text) <= most else "…" + text[len(text) - most + 1:]


def _change(app: App, job_id: int, action: str) -> Job:
    try:
        return getattr(app.queue, action)(job_id)
    except KeyError as e:
        raise click.ClickException(str(e.args[0])) from e
    except ValueError as e:
        raise click.ClickException(str(e)) from e


@main.command()
@click.argument("job_id", type=int)
@click.option("--path", "given", type=click.Path(path_type=Path),
              help="Where the job's file is now, if it was renamed or moved.")
@pass_app
def retry(app: App, job_id: int, given: Path | None) -> None:
    """Queue a failed, dead or cancelled job again. A job whose file is gone follows its content: to --path, or to
    the document in the inboxes that holds it."""
    job = app.queue.get(job_id)
    if job is None:
        raise click.ClickException(f"no job {job_id}")
    try:
        moved = content_now(job, app.config, inbox_folders(app.config, app.home), given)
        job = app.queue.retry(job_id, path=moved)
    except (OSError, ValueError) as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"#{job.id} queued again: {printable(job.path)}")


@main.command()
@click.argument("job_id", type=int)
@pass_app
def cancel(app: App, job_id: int) -> None:
    """Cancel a queued or running job."""
    job = _change(app, job_id, "cancel")
    click.echo(f"#{job.id} cancelled: {printable(job.path)}")


@main.group()
def config() -> None:
    """Inspect the configuration."""


@config.command("show")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@pass_app
def config_show(app: App, as_json: bool) -> None:
    """Print the effective config (file values over defaults) as TOML; passwords shown as ***."""
    effective = app.config.shown()
    if as_json:
        emit_json(effective)
        return
    notes = app.config.notes()
    for section, values in effective.items():
        click.echo(f"[{section}]")
        for key, value in values.items():
            note = notes[section].get(key)
            click.echo(f"{key} = {_toml(value)}" + (f"  # {note}" if note else ""))
        click.echo()


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(value)  # JSON strings and numbers are valid TOML

