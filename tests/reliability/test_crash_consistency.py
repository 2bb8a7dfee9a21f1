"""Crash consistency: the real daemon, SIGKILLed at seeded random moments and restarted, loses nothing.

Each life of the daemon ends in a SIGKILL at one of three kinds of moment, drawn from a seeded generator:
while it starts (imports, leftovers, reaping), in the middle of a document (a chunk of prefill, extraction,
a summary step), or just after an output folder appeared (completing the job, moving the original, claiming
the next). New documents arrive between and during lives. A last life runs until everything is done and is
stopped gracefully; then every document must have exactly one done job, one complete output set and one
original in processed/, with no temporary file anywhere in the home and a database that passes
`PRAGMA integrity_check`.

A job interrupted by a kill counts as an attempt (the queue's guard against a document that kills the worker
every time), so the home allows more attempts than there are kills: no document is given up for the kills.
Set NPUMOED_CHAOS_SEED to replay another schedule.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import documents
import pytest
from chaos_summary import Figures
from home_audit import audit, read_jobs
from sqlalchemy.exc import OperationalError

from npumoe.jobs.outputs import TMP_PREFIX

KILLS = 24
SEED = int(os.environ.get("NPUMOED_CHAOS_SEED", "8"))
FIRST_DOCUMENTS = 30
MOMENTS = {"startup": 1, "mid-document": 3, "after-output": 2}  # relative weights


def jobs_now(home: Path) -> list[Any]:
    """The jobs as `npumoed status` would read them; none while the daemon is still creating the queue."""
    try:
        return read_jobs(home / "npumoed.db")
    except (FileNotFoundError, OperationalError):
        return []


def outputs(home: Path) -> int:
    return sum(not p.name.startswith(TMP_PREFIX) for p in (home / "outbox").iterdir())


def all_done(home: Path, dropped: dict[str, str]) -> bool:
    done = {job.sha256 for job in jobs_now(home) if job.state == "done"}
    return done >= dropped.keys() and not any((home / "inbox").iterdir())


def wait_for_moment(moment: str, rng: random.Random, home: Path, pid: int, dropped: dict[str, str],
                    wait_for: Callable[..., bool]) -> None:
    """Return at a moment of the kind named, a little after it by a seeded random delay."""
    if moment == "startup":
        time.sleep(rng.uniform(0.0, 4.0))
    elif moment == "mid-document":
        wait_for(lambda: any(j.state == "running" and j.worker_pid == pid for j in jobs_now(home))
                 or all_done(home, dropped), timeout=120, interval=0.05)
        time.sleep(rng.uniform(0.0, 1.5))
    else:
        before = outputs(home)
        wait_for(lambda: outputs(home) > before or all_done(home, dropped), timeout=120, interval=0.02)
        time.sleep(rng.uniform(0.0, 0.05))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_sigkill_at_random_moments_loses_and_duplicates_no_document(
    home: Path,
    daemon_config: Callable[..., Path],
    start_npumoed: Callable[..., Any],
    wait_for: Callable[..., bool],
    chaos_figures: Figures,
) -> None:
    daemon_config(originals="move", max_attempts=KILLS + 2)
    rng = random.Random(SEED)
    (home / "inbox").mkdir(parents=True)
    dropped = documents.write(home / "inbox", range(FIRST_DOCUMENTS), paragraphs_each=4, formats=documents.FORMATS)
    next_number = FIRST_DOCUMENTS
    moments: Counter[str] = Counter()

    for _ in range(KILLS):
        daemon = start_npumoed("run")
        moment = rng.choices(list(MOMENTS), weights=list(MOMENTS.values()))[0]
        if rng.random() < 0.5:  # new documents arrive while it runs
            count = rng.randint(1, 3)
            new = range(next_number, next_number + count)
            dropped |= documents.write(home / "inbox", new, paragraphs_each=4, formats=documents.FORMATS)
            next_number += count
        wait_for_moment(moment, rng, home, daemon.process.pid, dropped, wait_for)
        assert daemon.process.poll() is None, f"the daemon exited on its own:\n{daemon.output()}"
        os.kill(daemon.process.pid, signal.SIGKILL)
        daemon.process.wait(timeout=30)
        moments[moment] += 1

    last = start_npumoed("run")
    assert wait_for(lambda: all_done(home, dropped), timeout=600, interval=0.5), last.output()
    last.process.send_signal(signal.SIGTERM)
    assert last.process.wait(timeout=60) == 0, last.output()

    result = audit(home, dropped, originals_moved=True)
    chaos_figures.add(f"crash: seed {SEED}, {dict(moments)}", kills=sum(moments.values()),
                      processed=result.processed, duplicates=len(result.duplicates), losses=len(result.losses))
    assert result.clean, result.problems()
    assert result.processed == len(dropped)
    assert max(job.attempts for job in result.jobs) > 1  # the kills did land on documents being processed
