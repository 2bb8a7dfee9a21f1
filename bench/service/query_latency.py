"""What a person waits for one `npumoed search`: whole commands (Python's start included), on a home that already
holds processed documents. The command embeds the query with the search model itself (jobs/search/sentence_model.py),
daemon or not, so one way is timed; every run must give the same hits (checked: the `--json` output's documents and
scores).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from npumoe.daemon.home import Home

QUERY = "which tokens give way when an expert is full"


@dataclass(frozen=True)
class Timed:
    seconds: float
    cpu_seconds: float  # user and system time of the command: what it takes where no other work shares the cores
    hits: list[tuple[str, float]]  # (document, score) of the top hits, in order


def npumoed_command() -> list[str]:
    """The `npumoed` this Python runs."""
    return [sys.executable, "-m", "npumoe.daemon"]


def timed_search(home: Path, query: str, k: int) -> Timed:
    """One whole `npumoed search QUERY --json` in `home`, timed from start to exit."""
    env = {**os.environ, "NPUMOED_HOME": str(home)}
    cpu_before, start = _children_cpu_seconds(), time.perf_counter()
    done = subprocess.run([*npumoed_command(), "search", query, "-k", str(k), "--json"], env=env,
                          capture_output=True, text=True, check=False)
    seconds, cpu_seconds = time.perf_counter() - start, _children_cpu_seconds() - cpu_before
    if done.returncode != 0:
        raise RuntimeError(f"npumoed search failed ({done.returncode}): {done.stderr.strip()}")
    return Timed(seconds, cpu_seconds, search_hits(json.loads(done.stdout)))


def _children_cpu_seconds() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def search_hits(output: dict) -> list[tuple[str, float]]:
    """(document, score) of each result in `npumoed search --json`'s output."""
    results = output["results"]
    return [(str(r["source"]), float(r["score"])) for r in results]


def measure(home: Path, runs: int, query: str = QUERY, k: int = 5) -> dict:
    """`runs` whole searches: their seconds and processor seconds, medians, and the load average before and after."""
    if not Home(home).database.is_file():
        raise ValueError(f"{home}: no queue database; process some documents first (npumoed demo)")
    before = os.getloadavg()
    timed = [timed_search(home, query, k) for _ in range(runs)]
    return {"query": query, "k": k, "runs": runs, "loadavg_before": before, "loadavg_after": os.getloadavg(),
            "seconds": [t.seconds for t in timed], "median_s": statistics.median(t.seconds for t in timed),
            "cpu_seconds": [t.cpu_seconds for t in timed],
            "median_cpu_s": statistics.median(t.cpu_seconds for t in timed),
            "same_hits": all(t.hits == timed[0].hits for t in timed), "hits": timed[0].hits}


def summary_lines(result: dict) -> Sequence[str]:
    return [f"npumoed search: median {result['median_s']:.2f} s of {result['runs']} whole commands "
            f"({result['median_cpu_s']:.2f} s of processor time)",
            f"same hits every time: {result['same_hits']}"]
