"""The commands that manage the daemon as a service: install, uninstall, pause, resume, batch, doctor."""

from __future__ import annotations

import dataclasses
import getpass
import os
import shutil
import sqlite3
import sys
import textwrap
import time
from functools import partial
from pathlib import Path

import click
from sqlalchemy.exc import SQLAlchemyError

from npumoe.engine.vocabulary import AUTO, COREML, CUDA
from npumoe.jobs.errors import DatabaseUnusable
from npumoe.jobs.queue.schema import SCHEMA_VERSION, schema_version
from npumoe.jobs.queue.store import BATCH, Queue

from ..batch import BatchWindow
from ..config import Config, ModelConfig, redacted_url
from ..energy.measure import ForegroundLoad, system_energy_counter
from ..energy.power import system_power_source
from ..energy.priority import available_cores, worker_threads
from ..home import Home, inbox_folders, outbox_folder
from ..intake import enqueue_paths
from ..model_choice import DEMO, DEMO_WEIGHTS, ModelNotFound, resolve_model
from ..scheduler import paused_since
from ..service import (
    Service,
    ServiceError,
    ServiceManager,
    Step,
    SystemdUser,
    carry_out,
    describe,
    lingering,
    service_manager,
)
from . import echo_job, job_dicts, report_skipped
from .app import App, emit_json, holding_home, pass_app

# Folders macOS guards with a privacy prompt that a LaunchAgent never gets to show.
PROTECTED = ("Documents", "Desktop", "Downloads")
RECOVERY = ("to recover, stop the daemon and run `npumoed doctor --rebuild-queue`: it moves this database aside "
            "(kept, not deleted) and records every finished document in the outbox as done again, from its "
            "meta.json; documents still waiting are queued again from the inbox (for a database from a newer "
            "npumoed, upgrading npumoed is the other way)")


# -- install / uninstall ----------------------------------------------------------------------------

@click.command()
@click.option("--dry-run", is_flag=True, help="Print what would be written and run; change nothing.")
@pass_app
def install(app: App, dry_run: bool) -> None:
    """Install and start the background service (LaunchAgent on macOS, systemd --user on Linux)."""
    manager = _manager()
    home = Home.current() if dry_run else app.home  # a dry run creates no folders
    _do(manager.install(Service.for_home(home, app.config_path)), dry_run,
        done=f"installed and started the {manager.name} service ({manager.path})")


@click.command()
@click.option("--dry-run", is_flag=True, help="Print what would be removed and run; change nothing.")
def uninstall(dry_run: bool) -> None:
    """Stop and remove the background service (the home and its documents stay)."""
    manager = _manager()
    _do(manager.uninstall(), dry_run, done=f"stopped and removed the {manager.name} service")


def _manager() -> ServiceManager:
    try:
        return service_manager()
    except ServiceError as e:
        raise click.ClickException(str(e)) from e


def _do(steps: list[Step], dry_run: bool, *, done: str) -> None:
    if dry_run:
        click.echo("would do, in order:")
        for step in steps:
            click.echo(f"  {describe(step)}")
        return
    try:
        carry_out(steps)
    except (ServiceError, OSError) as e:
        raise click.ClickException(str(e)) from e
    click.echo(done)


# -- pause / resume ---------------------------------------------------------------------------------

@click.command()
@pass_app
def pause(app: App) -> None:
    """Hold all work after the current chunk, until `npumoed resume`."""
    if paused := app.queue.controls.get("paused"):
        since = paused_since(paused)
        click.echo(f"already paused since {since:%Y-%m-%d %H:%M}" if since else "already paused")
        return
    app.queue.controls.set("paused", {"since": time.time()})
    click.echo("paused: the daemon stops after its current chunk; `npumoed resume` lets it go on")


@click.command()
@pass_app
def resume(app: App) -> None:
    """Let the daemon work again after `npumoed pause`."""
    was_paused = bool(app.queue.controls.get("paused"))
    app.queue.controls.set("paused", None)
    click.echo("resumed" if was_paused else "was not paused")


# -- batch ------------------------------------------------------------------------------------------

@click.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--window", metavar="HH:MM-HH:MM",
              help="Local time to run them in (default: scheduler.batch_window); 22:00-06:00 crosses midnight.")
@click.option("--json", "as_json", is_flag=True, help="Print the jobs as JSON.")
@pass_app
def batch(app: App, paths: tuple[Path, ...], window: str | None, as_json: bool) -> None:
    """Queue documents (files, or folders searched recursively) for the overnight window.

    They run only inside the window (and only on AC power when scheduler.batch_requires_ac is set);
    anything added with `npumoed add` goes first. A report is written to the home's reports/ folder
    when the window closes.
    """
    window = window or app.config.scheduler.batch_window
    try:
        window = str(BatchWindow.parse(window))
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--window") from e
    enqueued = enqueue_paths(app.queue, paths, app.config, priority=BATCH, batch_window=window,
                             on_job=None if as_json else partial(echo_job, queued=f"queued for {window}"))
    if as_json:
        emit_json({"window": window, "jobs": job_dicts(enqueued), "errors": enqueued.problems})
    elif enqueued.jobs:
        ac = " on AC power" if app.config.scheduler.batch_requires_ac else ""
        click.echo(f"{sum(created for _, created in enqueued.jobs)} document(s) will run between {window}{ac}")
    report_skipped(enqueued)


# -- doctor -----------------------------------------------------------------------------------------

@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON, each with its short line and details.")
@click.option("--verbose", "-v", is_flag=True, help="Print each check's details under its line.")
@click.option("--rebuild-queue", is_flag=True,
              help="Rebuild the list of finished documents from the outbox's meta.json files (after the queue "
                   "database was damaged); a database that cannot be used is moved aside first.")
@pass_app
def doctor(app: App, as_json: bool, verbose: bool, rebuild_queue: bool) -> None:
    """Check what the daemon depends on: service, queue database, inboxes, power state, CPU budget, energy,
    backends. One line per check; --verbose adds the details.

    Exits 1 when a check fails.
    """
    if rebuild_queue:
        _rebuild_queue(app)
        return
    checks = [*_service_checks(), _database_check(app.config, app.home),
              *(_inbox_check(folder) for folder in inbox_folders(app.config, app.home)),
              _power_check(), _load_check(), _cpu_check(app), _energy_check(), _kernel_check(),
              _measured_choices_check(), _weights_check(app), *_backend_checks(), _placement_check(app),
              _graph_accuracy_check(app)]
    if as_json:
        emit_json({"checks": checks})
    else:
        marks = {"ok": click.style("ok  ", fg="green"), "warn": click.style("warn", fg="yellow"),
                 "fail": click.style("FAIL", fg="red")}
        width = shutil.get_terminal_size().columns if sys.stdout.isatty() else DOCTOR_COLUMNS
        for check in checks:
            click.echo(f"{marks[check['status']]}  {_fitted(check['check'], check['summary'], width - len('warn  '))}")
            if verbose:
                for part in check["detail"].split(DETAIL_SEPARATOR):
                    click.echo(textwrap.fill(part, width, initial_indent=" " * 6, subsequent_indent=" " * 8))
    if any(check["status"] == "fail" for check in checks):
        raise SystemExit(1)


DOCTOR_COLUMNS = 120  # the width of a line when the output is not a terminal (a pipe, a file)
DETAIL_SEPARATOR = " | "  # between the items of a check's details: one line each under --verbose


def _check(name: str, status: str, detail: str, summary: str | None = None) -> dict[str, str]:
    """A check's result: its `summary` is the one line doctor prints (the details when they are that short)."""
    return {"check": name, "status": status, "summary": summary or detail, "detail": detail}


def _fitted(name: str, summary: str, width: int) -> str:
    """"name: summary" on one line of at most `width` characters: a long name (an inbox's path) keeps its first word
    and its end, and the summary is cut with an ellipsis where it is still too long."""
    summary = " ".join(summary.split())
    if len(name) + 2 + len(summary) > width and len(name) > width // 2:
        kind = name.split(" ", 1)[0]  # what is checked ("inbox"), then the end of which one
        name = f"{kind} …{name[-(width // 2 - len(kind) - 2):]}"
    line = f"{name}: {summary}"
    return line if len(line) <= width else line[:width - 1].rstrip() + "…"


def _service_checks() -> list[dict[str, str]]:
    try:
        manager = service_manager()
    except ServiceError as e:
        return [_check("service", "warn", str(e))]
    state = manager.state()
    running = state.startswith("installed, ") and any(w in state for w in ("running", "active"))
    hint = "" if running else " (`npumoed install` to run it in the background)"
    checks = [_check(f"service ({manager.name})", "ok" if running else "warn", state + hint)]
    if isinstance(manager, SystemdUser):
        checks.append(_linger_check(getpass.getuser()))
    return checks


def _linger_check(user: str) -> dict[str, str]:
    if lingering(user):
        return _check("lingering", "ok", f"systemd keeps {user}'s services running after logout")
    return _check("lingering", "warn", f"off: systemd --user stops the service when {user} logs out; "
                                       f"`loginctl enable-linger {user}` keeps it running",
                  f"off: the service stops when {user} logs out (`loginctl enable-linger {user}`)")


def _database_check(config: Config, home: Home) -> dict[str, str]:
    """The queue the daemon uses: the server of a shared queue, else the home's SQLite file."""
    if config.queue.url:
        return _server_check(config.queue.url)
    try:
        Queue(home.database).close()
    except DatabaseUnusable as e:
        return _check("queue database", "fail", f"{home.database}: {e}; {RECOVERY}")
    return _check("queue database", "ok", f"{home.database}: quick_check ok, schema v{SCHEMA_VERSION}, "
                                          f"SQLite {sqlite3.sqlite_version}")


def _server_check(url: str) -> dict[str, str]:
    shown = redacted_url(url)
    try:
        queue = Queue(url, read_only=True)
        try:
            with queue.db.read() as conn:
                version = schema_version(conn)
        finally:
            queue.close()
    except SQLAlchemyError as e:
        return _check("queue database", "fail", f"{shown}: cannot reach it: {str(getattr(e, 'orig', e)).strip()}")
    if version > SCHEMA_VERSION:
        return _check("queue database", "fail", f"{shown}: schema v{version} is newer than this npumoed "
                                                f"(v{SCHEMA_VERSION}); upgrade npumoed")
    later = f" (the first daemon to start migrates it to v{SCHEMA_VERSION})" if version < SCHEMA_VERSION else ""
    return _check("queue database", "ok", f"{shown}: reachable, schema v{version}{later}")


def _rebuild_queue(app: App) -> None:
    from npumoe.jobs.search.index import reindex

    from ..rebuild import rebuild_queue

    outbox = outbox_folder(app.config, app.home)
    with holding_home(app.home):
        try:
            rebuilt = rebuild_queue(app.home, app.config)
            indexed = reindex(app.home.database, outbox)  # the search index lived in the same database
        except (OSError, DatabaseUnusable) as e:
            raise click.ClickException(f"cannot rebuild the queue: {e}") from e
    for path in rebuilt.moved_aside:
        click.echo(f"moved the unusable database aside: {path}")
    for problem in rebuilt.skipped:
        click.echo(f"skipped {problem}", err=True)
    click.echo(f"{rebuilt.restored} finished document(s) recorded as done again from {outbox}; "
               f"{rebuilt.known} already known, {len(rebuilt.skipped)} skipped; "
               f"{indexed.documents} in the search index")


def _inbox_check(folder: Path) -> dict[str, str]:
    name = f"inbox {folder}"
    if not folder.is_dir():
        return _check(name, "fail", "missing or not a folder")
    try:
        os.listdir(folder)
    except OSError as e:
        return _check(name, "fail", f"cannot list it: {e.strerror}")
    if not os.access(folder, os.R_OK | os.W_OK | os.X_OK):
        return _check(name, "fail", "not readable and writable by you")
    protected = [Path.home() / p for p in PROTECTED]
    if sys.platform == "darwin" and any(folder.is_relative_to(p) for p in protected):
        return _check(name, "warn", "readable from this terminal, but macOS keeps ~/Documents, ~/Desktop and "
                                    "~/Downloads from a LaunchAgent; choose an inbox elsewhere")
    return _check(name, "ok", "readable and writable")


def _power_check() -> dict[str, str]:
    state = system_power_source().read()
    if state.on_ac is None:
        power = "no battery information (treated as AC power)"
    else:
        power = "on AC power" if state.on_ac else "on battery"
        if state.battery_percent is not None:
            power += f", battery {state.battery_percent:.0f}%"
    def said(value: object) -> str:
        return "not reported here" if value is None else str(value)
    detail = (f"{power}; Low Power Mode: {said(state.low_power_mode)}; "
              f"thermal pressure: {said(state.thermal_pressure)}")
    return _check("power state", "ok" if state.on_ac is not None else "warn", detail, power)


def _load_check() -> dict[str, str]:
    load = ForegroundLoad(window=0.5)()
    return _check("foreground load", "ok", f"{load:.0%} of {available_cores()} core(s) busy with other work")


def _cpu_check(app: App) -> dict[str, str]:
    cpu = app.config.cpu
    priority = "background priority" if cpu.background_priority else "normal priority (cpu.background_priority)"
    return _check("CPU budget", "ok", f"{worker_threads(cpu)} worker thread(s) of {available_cores()} core(s), "
                                      f"at {priority}")


def _energy_check() -> dict[str, str]:
    counter = system_energy_counter()
    measurable = counter.read() is not None
    return _check("energy", "ok" if measurable else "warn", counter.description)


def _kernel_check() -> dict[str, str]:
    """The matmul kernel the CPU experts run and the figures that chose it, for bf16 experts of qwen3-30b-a3b's
    size (timed now if this machine has not yet); a warning where this CPU could run the engine's own kernel but
    it did not build."""
    import torch

    from npumoe.engine.kernels import bf16_linear
    from npumoe.engine.kernels.float_kernels import CHOICES, choose_for_shape, expert_shape
    from npumoe.engine.kernels.host import cpu_model
    from npumoe.engine.synthetic.geometry import GEOMETRIES

    reference = GEOMETRIES["qwen3-30b-a3b"]
    key = CHOICES.key(torch.bfloat16, expert_shape(reference.hidden, reference.ffn), threads=1)
    measured = choose_for_shape(reference.hidden, reference.ffn, torch.bfloat16)
    not_built = bf16_linear.unsupported_cpu() is None and bf16_linear.unavailable() is not None
    return _check("cpu kernel", "warn" if not_built else "ok",
                  f"{key} ({reference.name}): {measured.describe()} (on {cpu_model()}, torch {torch.__version__})",
                  f"{measured.describe()}, for {reference.name}'s bf16 experts")


def _measured_choices_check() -> dict[str, str]:
    """Every choice this machine has measured and cached, of every kind (each is made at the first load that
    needs it, not by doctor, but for the reference kernel above), with the figures that made it."""
    # every kind of measured choice, imported so that each is known to the mechanism
    from npumoe.engine.attach import projections  # noqa: F401
    from npumoe.engine.generate import chunk_length  # noqa: F401
    from npumoe.engine.kernels import attention_choice, float_kernels, quant_kernels  # noqa: F401
    from npumoe.engine.kernels.choice import cached_choices
    from npumoe.engine.loading import auto_weights  # noqa: F401

    cached = {kind: choices for kind, choices in sorted(cached_choices().items()) if choices}
    if not cached:
        return _check("measured choices", "ok", "none yet: each is measured at the first model load that needs it")
    measured = [f"{kind}: " + "; ".join(f"{key}: {choice.describe()}" for key, choice in choices.items())
                for kind, choices in cached.items()]
    counts = ", ".join(f"{kind} {len(choices)}" for kind, choices in cached.items())
    return _check("measured choices", "ok", DETAIL_SEPARATOR.join(measured),
                  f"{sum(map(len, cached.values()))} cached ({counts})")


def _weights_check(app: App) -> dict[str, str]:
    """The format the configured model's weights run in and why: for auto, the choice the engine makes at load,
    made here the same way (measured once per machine, then cached)."""
    m = app.config.model
    if m.weights != AUTO:
        return {**_check("weights", "ok", f"{m.weights}, set by [model] weights"), "weights": m.weights}
    if m.name == DEMO:  # as the daemon's engine settings resolve it (model_choice.engine_settings)
        return {**_check("weights", "ok", f"auto -> {DEMO_WEIGHTS}, the demo model's format: a 135M model's "
                                          "summaries change in bf16"), "weights": DEMO_WEIGHTS}
    from npumoe.engine.errors import ModelError
    from npumoe.engine.loading.auto_weights import choose_model_weights

    try:
        ref = resolve_model(m.name)
        _, choice = choose_model_weights(ref, allow_download=False, trust_remote_code=m.trust_remote_code)
    except (ModelNotFound, ModelError, ValueError) as e:
        return _check("weights", "warn", f"auto: cannot decide for {m.name}: {e}")
    return {**_check("weights", "ok" if choice.fits else "warn", f"auto -> {choice.reason}"),
            "weights": choice.weights}


def _backend_checks() -> list[dict[str, str]]:
    """Each backend the config offers: built into the engine here, and able to run on this machine."""
    from npumoe.engine.backends.registry import REGISTRY

    choices = next(f for f in dataclasses.fields(ModelConfig) if f.name == "backend").metadata["choices"]
    checks = []
    for name in choices:
        ok, why = _backend_ready(name) if name in REGISTRY else (False, "not built into this engine yet")
        checks.append(_check(f"backend {name}", "ok" if ok else "warn", why))
    return checks


def _placement_check(app: App) -> dict[str, str]:
    """Where Core ML places the compiled group graphs' ops, totalled over the costs measured in this home."""
    from npumoe.engine.plan.cost_cache import CostCache

    measured = [(name, costs) for name, costs in CostCache(app.home.costs).everything()
                if name.startswith(f"{COREML}-") and any(m.ops for m in costs.groups.values())]
    if not measured:
        return _check("Neural Engine placement", "ok", "not read yet: `npumoed prepare --backend coreml` on a Mac "
                                                       "reads it from each compiled graph's compute plan",
                      "not read yet (`npumoed prepare --backend coreml` on a Mac)")
    groups = [m for _, costs in measured for m in costs.groups.values() if m.ops]
    on_engine, ops = sum(m.device_ops for m in groups), sum(m.ops for m in groups)
    off = sum(m.device_ops < m.ops for m in groups)
    detail = f"{on_engine} of {ops} ops on the Neural Engine ({on_engine / ops:.0%}) over {len(groups)} group graphs"
    if off:
        detail += f"; {off} graphs have ops off it (those mostly off it run on the CPU instead)"
    return _check("Neural Engine placement", "warn" if off else "ok", detail)


def _graph_accuracy_check(app: App) -> dict[str, str]:
    """The accelerator graphs the accuracy gate refused, over the costs measured in this home."""
    from npumoe.engine.plan.cost_cache import CostCache

    refused = [f"{name.rsplit('-', 2)[0]} group {key}: {why}" for name, costs in CostCache(app.home.costs).everything()
               for key, why in costs.refused.items()]
    return _check("accelerator graphs", "warn" if refused else "ok",
                  "; ".join(refused) + " (those groups run on the CPU)" if refused
                  else "none refused by the accuracy gate (each placed graph matched the CPU path on a probe)")


def _backend_ready(name: str) -> tuple[bool, str]:
    if name == COREML:
        from npumoe.engine.backends.coreml.env import coreml_availability

        return coreml_availability()
    if name == CUDA:
        from npumoe.engine.backends.cuda.env import cuda_availability

        return cuda_availability()
    return True, "available"
