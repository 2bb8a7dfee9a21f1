"""What a person waits for one `npumoed search`: whole commands (Python's start included), timed without the daemon
(the command loads the model itself) and with it running (it asks the daemon over its socket), on a home that
already holds processed documents.

The daemon is started here (`npumoed run`, its own process), waited for until its socket answers, and stopped with
SIGTERM after. Its first query is kept apart: an idle daemon may have unloaded the model (`idle_unload_seconds`) and
loads it once. Each way gives the same hits (checked: the top passages of the two ways' `--json` output), so the
difference is where the query's vector was made.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from npumoe.daemon.home import Home

QUERY = "which tokens give way when an expert is full"
SELF_LOAD = "loading the model here instead"  # what `npumoed search` says when the daemon does not answer
START_SECONDS = 600.0  # the daemon's start: loading the model on a busy 2-core machine takes minutes


@dataclass(frozen=True)
class Timed:
    seconds: float
    hits: list[tuple[str, float]]  # (document, score) of the top hits, in order
    loaded_itself: bool  # stderr said the daemon did not answer and the command loaded the model


def npumoed_command() -> list[str]:
    """The `npumoed` this Python runs."""
    return [sys.executable, "-m", "npumoe.daemon"]


def timed_search(home: Path, query: str, k: int) -> Timed:
    """One whole `npumoed search QUERY --json` in `home`, timed from start to exit."""
    env = {**os.environ, "NPUMOED_HOME": str(home)}
    start = time.perf_counter()
    done = subprocess.run([*npumoed_command(), "search", query, "-k", str(k), "--json"], env=env,
                          capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"npumoed search failed ({done.returncode}): {done.stderr.strip()}")
    return Timed(seconds, search_hits(json.loads(done.stdout)), SELF_LOAD in done.stderr)


def search_hits(output: dict) -> list[tuple[str, float]]:
    """(document, score) of each result in `npumoed search --json`'s output."""
    results = output["results"]
    return [(str(r["source"]), float(r["score"])) for r in results]


def measure(home: Path, runs: int, query: str = QUERY, k: int = 5) -> dict:
    """`runs` searches without the daemon, then the daemon started and one first query, then `runs` more: each
    way's seconds, median and the load average before and after."""
    if not Home(home).database.is_file():
        raise ValueError(f"{home}: no queue database; process some documents first (npumoed demo)")
    if Home(home).socket.exists():
        raise ValueError(f"{home}: a daemon's socket is there already; stop it first")
    before = os.getloadavg()
    alone = [timed_search(home, query, k) for _ in range(runs)]
    daemon = _start_daemon(home)
    try:
        first = timed_search(home, query, k)
        served = [timed_search(home, query, k) for _ in range(runs)]
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=120)
    if any(t.loaded_itself for t in served):  # without a socket there is no daemon to ask: those load it
        raise RuntimeError("a search with the daemon running loaded the model itself: the daemon did not answer")
    return {"query": query, "k": k, "runs": runs, "loadavg_before": before, "loadavg_after": os.getloadavg(),
            "without_daemon_s": [t.seconds for t in alone], "with_daemon_first_s": first.seconds,
            "with_daemon_s": [t.seconds for t in served],
            "median_without_daemon_s": statistics.median(t.seconds for t in alone),
            "median_with_daemon_s": statistics.median(t.seconds for t in served),
            "same_hits": all(t.hits == alone[0].hits for t in [*alone, first, *served]),
            "hits": alone[0].hits}


def _start_daemon(home: Path) -> subprocess.Popen:
    """`npumoed run` in `home`, once its socket answers a query (the model loaded)."""
    env = {**os.environ, "NPUMOED_HOME": str(home)}
    log = (home / "logs").joinpath("query-latency-daemon.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        daemon = subprocess.Popen([*npumoed_command(), "run"], env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_SECONDS
    while not Home(home).socket.exists():
        if daemon.poll() is not None or time.monotonic() > deadline:
            daemon.kill()
            raise RuntimeError(f"the daemon did not start (exit {daemon.returncode}); see {log}")
        time.sleep(0.5)
    return daemon


def summary_lines(result: dict) -> Sequence[str]:
    return [f"without the daemon: median {result['median_without_daemon_s']:.2f} s of {result['runs']}",
            f"with the daemon: median {result['median_with_daemon_s']:.2f} s of {result['runs']} "
            f"(the first {result['with_daemon_first_s']:.2f} s)",
            f"same hits both ways: {result['same_hits']}"]
