"""Foreground slowdown: a fixed CPU-bound workload on every core, alone and while the daemon works.

    npumoed bench foreground [--rounds 5] [--json FILE]

The daemon is a real `npumoed run` process on a temporary home with the default config (the
built-in demo model, default CPU budget and scheduler), fed with copies of the sample documents.
"Alone" is the same daemon paused and quiet, so both conditions hold the same memory; rounds
alternate the order of the two conditions, so drift on a shared machine hits both alike. The result
is the median of the per-round ratios (with / alone) and the daemon's throughput while it yields.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click
import psutil
from rich.console import Console
from rich.table import Table

from npumoe.daemon.batch import job_meta
from npumoe.daemon.config import ConfigError, load_config
from npumoe.daemon.home import Home
from npumoe.daemon.intake import enqueue
from npumoe.daemon.samples import write_samples
from npumoe.jobs.queue.schema import DONE, QUEUED, RUNNING
from npumoe.jobs.queue.store import Queue

COPYABLE = (".md", ".txt", ".html")  # formats a trailing line can make distinct without breaking them


def spin(units: int) -> int:
    """The fixed foreground work: `units` steps of integer arithmetic in pure Python (one core)."""
    x = 0
    for i in range(units):
        x = (x * 1103515245 + i) & 0xFFFFFFFF
    return x


@dataclass
class Run:
    condition: str  # "alone" or "with daemon"
    seconds: float
    daemon_cpu_seconds: float
    daemon_tokens: int
    daemon_documents: int
    daemon_working_at_start: bool


class Daemon:
    """A `npumoed run` process on its own home, and what can be read about it from outside."""

    def __init__(self, home: Path, config: Path | None = None) -> None:
        self.home = Home(home)
        self.env = {**os.environ, "NPUMOED_HOME": str(home)}
        self.queue = Queue(self.home.ensure().database)
        self.process: subprocess.Popen[bytes] | None = None
        if config is not None:
            shutil.copyfile(config, self.home.root / "config.toml")
        self.config = load_config(self.home.root / "config.toml" if config is not None else None)

    def feed(self, copies: int) -> int:
        """Queue the sample documents and `copies` distinct copies of the text-like ones."""
        folder = self.home.root / "bench-documents"
        paths = write_samples(folder)
        copyable = [p for p in paths if p.suffix in COPYABLE]
        for n in range(copies):
            for sample in copyable:
                copy = folder / f"{sample.stem}-{n}{sample.suffix}"
                note = f"\n<!-- copy {n} -->\n" if sample.suffix == ".html" else f"\n\nCopy {n}.\n"
                copy.write_bytes(sample.read_bytes() + note.encode())
                paths.append(copy)
        for path in paths:
            enqueue(self.queue, path, self.config)
        return len(paths)

    def start(self) -> None:
        log = (self.home.logs / "bench-daemon.log").open("ab")
        self.process = subprocess.Popen([sys.executable, "-m", "npumoe.daemon", "run"], env=self.env,
                                        stdout=log, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def pause(self, paused: bool) -> None:
        self.queue.controls.set("paused", {"since": time.time()} if paused else None)

    def activity(self) -> str:
        if self.process is not None and self.process.poll() is not None:
            raise click.ClickException(f"the daemon exited with status {self.process.returncode}; "
                                       f"see {self.home.logs / 'bench-daemon.log'}")
        row = self.queue.daemons.read()
        return (row or {}).get("activity") or "starting"

    def wait_for(self, done: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True

    def progress(self) -> tuple[int, int]:
        """(tokens prefilled, documents done) so far: meta.json of done jobs, live detail of running ones."""
        tokens = documents = 0
        for job in self.queue.list():
            if job.state == DONE:
                tokens += int(job_meta(job).get("tokens") or 0)
                documents += 1
            elif job.state == RUNNING and job.detail:
                tokens += int(json.loads(job.detail).get("tokens_done") or 0)
        return tokens, documents

    def cpu_seconds(self) -> float:
        """CPU seconds of the daemon's whole process tree so far."""
        assert self.process is not None
        try:
            root = psutil.Process(self.process.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0.0
        total = 0.0
        for p in tree:
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system + t.children_user + t.children_system
        return total

    def waiting_documents(self) -> int:
        return self.queue.counts()[QUEUED]


def measure(daemon: Daemon, pool: Any, processes: int, work: int, condition: str, settle_s: float) -> Run:
    """One timed run of the foreground workload, with the daemon paused ("alone") or let go."""
    alone = condition == "alone"
    daemon.pause(alone)
    if alone:
        daemon.wait_for(lambda: daemon.activity() != "working", settle_s)
        working = False
    else:
        working = daemon.wait_for(lambda: daemon.activity() == "working", settle_s)
    cpu0, (tokens0, docs0) = daemon.cpu_seconds(), daemon.progress()
    started = time.perf_counter()
    pool.map(spin, [work] * processes, chunksize=1)
    seconds = time.perf_counter() - started
    tokens1, docs1 = daemon.progress()
    return Run(condition, seconds, daemon.cpu_seconds() - cpu0, tokens1 - tokens0, docs1 - docs0, working)


def summarise(runs: list[Run], solo: dict[str, float], cores: int) -> dict[str, Any]:
    alone = [r for r in runs if r.condition == "alone"]
    with_daemon = [r for r in runs if r.condition != "alone"]
    ratios = [w.seconds / a.seconds for a, w in zip(alone, with_daemon, strict=True)]
    busy_s = sum(r.seconds for r in with_daemon)
    return {
        "median_alone_s": statistics.median(r.seconds for r in alone),
        "median_with_daemon_s": statistics.median(r.seconds for r in with_daemon),
        "ratios": ratios,
        "median_slowdown_ratio": statistics.median(ratios),
        "daemon_while_yielding": {
            "tokens_per_s": sum(r.daemon_tokens for r in with_daemon) / busy_s,
            "documents_per_s": sum(r.daemon_documents for r in with_daemon) / busy_s,
            "cpu_seconds_per_s": sum(r.daemon_cpu_seconds for r in with_daemon) / busy_s,
            # the CPU taken from the foreground at most (cache and memory effects aside)
            "share_of_all_cores": sum(r.daemon_cpu_seconds for r in with_daemon) / busy_s / cores,
            "runs_started_while_working": sum(r.daemon_working_at_start for r in with_daemon),
        },
        "daemon_alone": solo,
    }


def solo_throughput(daemon: Daemon, seconds: float) -> dict[str, float]:
    """The daemon's own pace with nothing in the foreground, for comparison."""
    daemon.pause(False)
    tokens0, docs0 = daemon.progress()
    cpu0 = daemon.cpu_seconds()
    time.sleep(seconds)
    tokens1, docs1 = daemon.progress()
    return {"seconds": seconds, "tokens_per_s": (tokens1 - tokens0) / seconds,
            "documents_per_s": (docs1 - docs0) / seconds,
            "cpu_seconds_per_s": (daemon.cpu_seconds() - cpu0) / seconds}


def show(runs: list[Run], summary: dict[str, Any], processes: int, work: int) -> None:
    console = Console()
    table = Table("round", "condition", "seconds", "daemon CPU s", "daemon tokens", "daemon working at start",
                  title=f"foreground: {processes} processes x {work:,} steps")
    for i, run in enumerate(runs):
        table.add_row(str(i // 2 + 1), run.condition, f"{run.seconds:.3f}", f"{run.daemon_cpu_seconds:.2f}",
                      str(run.daemon_tokens), "yes" if run.daemon_working_at_start else "-")
    console.print(table)
    y, solo = summary["daemon_while_yielding"], summary["daemon_alone"]
    ratios = summary["ratios"]
    console.print(f"median slowdown: x{summary['median_slowdown_ratio']:.3f} over {len(ratios)} rounds "
                  f"(ratios {min(ratios):.3f} to {max(ratios):.3f}; median alone {summary['median_alone_s']:.3f} s, "
                  f"with the daemon {summary['median_with_daemon_s']:.3f} s)")
    console.print(f"daemon while yielding: {y['tokens_per_s']:.1f} tokens/s, {y['documents_per_s']:.3f} docs/s, "
                  f"{y['cpu_seconds_per_s']:.3f} CPU s/s ({y['share_of_all_cores']:.1%} of all cores); "
                  f"working at the start of "
                  f"{y['runs_started_while_working']} of {len(runs) // 2} runs")
    console.print(f"daemon with the machine to itself: {solo['tokens_per_s']:.1f} tokens/s, "
                  f"{solo['documents_per_s']:.3f} docs/s, {solo['cpu_seconds_per_s']:.3f} CPU s/s")


@click.command("foreground")
@click.option("--rounds", type=click.IntRange(min=1), default=5, show_default=True,
              help="Pairs of runs (alone, with the daemon).")
@click.option("--work", type=click.IntRange(min=1), default=40_000_000, show_default=True,
              help="Steps of arithmetic per foreground process.")
@click.option("--processes", type=click.IntRange(min=1), default=None,
              help="Foreground processes [default: one per core].")
@click.option("--copies", type=click.IntRange(min=0), default=60, show_default=True,
              help="Copies of each text-like sample document to queue (the daemon must not run dry).")
@click.option("--warmup-timeout", type=float, default=900.0, show_default=True,
              help="Seconds to wait for the daemon to finish its first document (model load included).")
@click.option("--settle-timeout", type=float, default=60.0, show_default=True,
              help="Seconds to wait for the daemon to stop or start working before a run.")
@click.option("--solo-seconds", type=float, default=20.0, show_default=True,
              help="Seconds to measure the daemon alone, for comparison.")
@click.option("--daemon-config", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A config.toml for the daemon instead of the defaults (to compare settings).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the machine description, the settings and every run to this JSON file.")
@click.option("--keep-home", is_flag=True, help="Keep the temporary home (daemon log, outputs).")
def foreground(rounds: int, work: int, processes: int | None, copies: int, warmup_timeout: float,
               settle_timeout: float, solo_seconds: float, daemon_config: Path | None, json_path: Path | None,
               keep_home: bool) -> None:
    """How much the daemon, at default settings, slows a CPU-bound workload that uses every core."""
    processes = processes or psutil.cpu_count() or 1
    if daemon_config is not None:
        try:
            load_config(daemon_config)
        except ConfigError as e:
            raise click.BadParameter(str(e), param_hint="--daemon-config") from e
    home = Path(tempfile.mkdtemp(prefix="npumoed-bench-"))
    daemon = Daemon(home, daemon_config)
    try:
        documents = daemon.feed(copies)
        click.echo(f"queued {documents} documents in {home}; starting the daemon")
        daemon.start()
        if not daemon.wait_for(lambda: daemon.progress()[1] > 0, warmup_timeout):
            raise click.ClickException(f"the daemon finished no document within {warmup_timeout:.0f} s; "
                                       f"see {daemon.home.logs / 'bench-daemon.log'}")
        solo = solo_throughput(daemon, solo_seconds)
        runs: list[Run] = []
        with multiprocessing.get_context("spawn").Pool(processes) as pool:
            pool.map(spin, [1000] * processes)  # start the workers before timing
            for round_ in range(rounds):
                order = ("alone", "with daemon") if round_ % 2 == 0 else ("with daemon", "alone")
                pair = {c: measure(daemon, pool, processes, work, c, settle_timeout) for c in order}
                runs += [pair["alone"], pair["with daemon"]]
                if daemon.waiting_documents() == 0:
                    click.echo("warning: the daemon ran out of documents; use more --copies", err=True)
        daemon.stop()
        summary = summarise(runs, solo, psutil.cpu_count() or 1)
        show(runs, summary, processes, work)
        if json_path is not None:
            from ..machine import describe_machine

            settings = {"rounds": rounds, "work": work, "processes": processes, "documents": documents,
                        "daemon_config": daemon.config.as_dict()}
            record = {"machine": describe_machine(processes), "settings": settings,
                      "results": {"runs": [asdict(r) for r in runs], **summary}}
            json_path.write_text(json.dumps(record, indent=2) + "\n")
            click.echo(f"wrote {json_path}")
    finally:
        daemon.stop()
        daemon.queue.close()
        if keep_home:
            click.echo(f"kept {home}")
        else:
            shutil.rmtree(home, ignore_errors=True)
