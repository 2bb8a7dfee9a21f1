"""`npumoed run`, `npumoed status` and `npumoed demo`: the daemon itself, what it is doing, and a tour.

Heavy imports (torch, the engine, the worker) happen inside the commands, so `npumoed status` stays fast.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console, RenderableType
from rich.live import Live
from rich.text import Text
from sqlalchemy.exc import DatabaseError, OperationalError, ProgrammingError

from npumoe.engine.vocabulary import TORCH_STATIC
from npumoe.jobs.outputs import temporary_path
from npumoe.jobs.queue.database import damage
from npumoe.jobs.queue.schema import DONE
from npumoe.jobs.queue.store import Queue

from ..config import Config
from ..home import Home, outbox_folder
from .app import App, BadConfig, UnusableDatabase, emit_json, pass_app
from .status_view import render_rich, render_text, snapshot

DEMO_BACKEND = TORCH_STATIC  # NPUMoE's static-shape executor, the reference for accelerators


@click.command()
@click.option("--once", is_flag=True, help="Process what is in the inboxes and the queue now, then exit.")
@click.option(
    "--inbox",
    "inboxes",
    multiple=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Watch this folder instead of the configured inboxes (repeatable).",
)
@click.option("-v", "--verbose", is_flag=True, help="Log debug detail.")
@pass_app
def run(app: App, once: bool, inboxes: tuple[Path, ...], verbose: bool) -> None:
    """Run the daemon in the foreground (what the service manager starts).

    Stops gracefully on SIGTERM or Ctrl-C: the running document goes back to the queue.
    """
    _run_worker(app, app.config, inboxes=list(inboxes) or None, once=once, verbose=verbose, obey_schedule=True)


@click.command()
@click.option("--watch", is_flag=True, help="Keep the view up to date until Ctrl-C.")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON, for scripts.")
@click.option("--interval", type=click.FloatRange(min=0.2), default=1.0, show_default=True, help="--watch refresh.")
@pass_app
def status(app: App, watch: bool, as_json: bool, interval: float) -> None:
    """What the daemon is doing, the queue, recent results, and why it waits when it does.

    On a queue several machines share (`[queue] url`), every machine's workers too.
    """
    home, url = Home.current(), app.config.queue.url
    if as_json:
        emit_json({"home": str(home.root), **(read_status(home, url) or {"daemon": {"state": "never started"}})})
    elif watch:
        _watch(home, interval, url)
    else:
        _show(home, url)


def read_status(home: Home, url: str = "") -> dict[str, Any] | None:
    """The status snapshot, read-only; None while there is no queue to read (npumoed never ran, or is just
    creating its database). `url`: the shared queue's, when the config names one."""
    try:
        queue = Queue(url or home.database, read_only=True, home=home.root)
    except FileNotFoundError:
        return None
    try:
        return snapshot(queue)
    except (OperationalError, ProgrammingError) as e:
        if "no such table" in str(e) or "UndefinedTable" in type(e.orig).__name__:
            return None
        raise
    except DatabaseError as e:
        if problem := damage(e):
            raise UnusableDatabase(home.database, problem) from e
        raise
    finally:
        queue.close()


@click.command()
@pass_app
def demo(app: App) -> None:
    """Process the built-in sample documents offline with the demo model, then show where it all went.

    The demo model is SmolLM2-135M-Instruct made an 8-expert top-1 MoE (its summaries are SmolLM2's). The first run
    makes it from the weights setup fetched and calibrates an expert plan on the samples, so the documents go
    through NPUMoE's static-shape path (torch-static backend).
    """
    from ..intake import job_keys, sha256_of
    from ..samples import write_samples

    home, queue = app.home, app.queue
    _keep_caches_at_home(home)
    os.umask(0o077)
    staged = temporary_path(home.root, "samples")
    try:
        samples = {path.name: sha256_of(path) for path in write_samples(staged)}
        # The longest sample would triple calibration time and add no routing the others lack.
        calibration_data = sorted(staged.iterdir(), key=lambda p: p.stat().st_size)[:-1]
        config = _demo_config(app.config, home, calibration_data)
        keys = job_keys(config)
        done = {job.sha256 for job in queue.list(DONE) if (job.model_key, job.settings_key) == keys}
        new = [name for name, sha in samples.items() if sha not in done]
        for name in new:
            (staged / name).replace(home.inbox / name)  # one rename: the watcher never sees half a file
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    click.echo(f"{len(new)} sample document(s) placed in {home.inbox}; {len(samples) - len(new)} already done")
    _run_worker(app, config, inboxes=[home.inbox], once=True, verbose=False, obey_schedule=False)
    click.echo("\nOutputs:")
    jobs = {(job.sha256, job.model_key, job.settings_key): job for job in queue.list()}
    for name, sha in samples.items():
        job = jobs.get((sha, *keys))
        where = f"{job.output_dir}/" if job and job.state == DONE else job.last_error if job else "not queued"
        click.echo(f"  {name}: {where}")
    click.echo()
    _show(home, config.queue.url)
    click.echo(f"\nThe demo model is SmolLM2-135M-Instruct upcycled to an MoE: the summaries are its own, a 135M "
               f"model's. Home: {home.root}")


def _run_worker(
    app: App, config: Config, *, inboxes: list[Path] | None, once: bool, verbose: bool, obey_schedule: bool
) -> None:
    from npumoe.jobs.errors import IdentityInUse, ModelUnavailable

    from ..logs import setup_logging
    from ..service import started_by_service
    from ..worker import AlreadyRunning, Worker

    plan = Path(config.model.plan).expanduser()
    if config.model.plan and not plan.is_file():  # now: later each document would look as if it had vanished
        raise BadConfig(f"'model.plan' names {plan}, which is not a file (make one with `npumoed calibrate`)")
    _keep_caches_at_home(app.home)
    log_file = setup_logging(app.home.logs, verbose=verbose, to_stderr=not started_by_service())
    worker = Worker(config, app.home, app.queue, inboxes=inboxes, once=once, obey_schedule=obey_schedule)
    try:
        summary = worker.run()
    except (AlreadyRunning, IdentityInUse) as e:
        raise click.ClickException(str(e)) from e
    except ModelUnavailable as e:
        raise click.ClickException(f"cannot load the model: {e} (log: {log_file})") from e
    if once:
        outcomes = ", ".join(f"{n} {state}" for state, n in sorted(summary.outcomes.items())) or "nothing to do"
        rejected = f"; {summary.rejected} file(s) could not be queued" if summary.rejected else ""
        later = f"; {summary.waiting} job(s) wait for later (retry or batch window)" if summary.waiting else ""
        click.echo(f"npumoed: {outcomes}{rejected}{later}. Outputs: {outbox_folder(app.config, app.home)}")


def _keep_caches_at_home(home: Home) -> None:
    """torch makes its compile cache in the system temp folder unless told otherwise; the daemon keeps all
    of its state in the home."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(home.compiled / "torch"))


def _show(home: Home, url: str) -> None:
    if sys.stdout.isatty():
        Console().print(_draw(read_status(home, url), home, rich=True))
    else:
        click.echo(_draw(read_status(home, url), home, rich=False))


def _watch(home: Home, interval: float, url: str) -> None:
    try:
        if not sys.stdout.isatty():
            while True:
                click.echo(f"{_draw(read_status(home, url), home, rich=False)}\n")
                time.sleep(interval)
        with Live(_draw(read_status(home, url), home, rich=True), auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                live.update(_draw(read_status(home, url), home, rich=True), refresh=True)
    except KeyboardInterrupt:
        pass


def _draw(snap: dict[str, Any] | None, home: Home, *, rich: bool) -> RenderableType:
    if snap is None:
        return Text(f"npumoed has not run in {home.root} yet (no queue database)")  # Text: no markup in a path
    return render_rich(snap) if rich else render_text(snap)


# -- the demo ---------------------------------------------------------------------------------------------


def _demo_config(config: Config, home: Home, calibration_data: list[Path]) -> Config:
    """The configured settings with the built-in model on the static (NPUMoE) backend, its plan calibrated on
    the samples once and reused after (a new plan would make every sample new work again)."""
    from .engine import calibrate_documents

    plan = home.plans / "demo.json"
    if not plan.exists():
        click.echo(f"calibrating an expert plan for the demo model on the samples: {plan}")
        calibrate_documents("demo", calibration_data, plan, chunk_tokens=config.model.plan_chunk_tokens)
    model = dataclasses.replace(config.model, name="demo", backend=DEMO_BACKEND, plan=str(plan))
    cpu = dataclasses.replace(config.cpu, background_priority=False)  # someone is watching: no need to yield
    return dataclasses.replace(config, model=model, cpu=cpu)
