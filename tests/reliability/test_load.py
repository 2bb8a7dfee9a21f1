"""Load: a thousand documents dropped at once, and a hundred more while the daemon is stopped.

Every one must be processed exactly once (one attempt, one done job, one complete output set, one original
in processed/), and `npumoed status --json` must answer throughout: it is sampled in a subprocess every
couple of seconds from the first start to the last stop, the daemon stopped in between included. Its
latency is reported in the chaos summary line, not asserted (this machine's cores are shared). The daemon
runs at the background priority it is deployed with (nice 19, SCHED_IDLE on Linux), so `status`, like any
program the person runs, comes first.

The documents are one short sentence (one or two 64-token chunks) and the summary two tokens, so 1,100 of
them go through the tiny model in minutes on two cores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import documents
import pytest
from chaos_summary import Figures
from home_audit import audit, read_jobs
from sqlalchemy.exc import OperationalError

AT_ONCE = 1000
WHILE_STOPPED = 100
SAMPLE_EVERY_S = 2.0
TINY = (3, 8)  # words per document


@dataclass
class StatusSampler:
    """Runs `npumoed status --json` over and over on a thread, timing each answer."""

    npumoed: Callable[..., subprocess.CompletedProcess[str]]
    seconds: list[float] = field(default_factory=list)
    seen: list[str] = field(default_factory=list)  # what each answer said the daemon was doing
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> StatusSampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            answer = self.npumoed("status", "--json", timeout=120)
            self.seconds.append(time.perf_counter() - started)
            try:
                daemon = json.loads(answer.stdout)["daemon"]
                self.seen.append(f"{daemon['state']} {daemon.get('activity') or ''}".strip())
            except (ValueError, KeyError) as e:
                self.seen.append("no answer")
                self.errors.append(f"rc {answer.returncode}: {e}: {answer.stderr[-500:]}")
            self._stop.wait(SAMPLE_EVERY_S)

    @property
    def slowest(self) -> str:
        if not self.seconds:
            return "no status answers"
        seconds, seen = max(zip(self.seconds, self.seen, strict=True))
        return f"slowest status {seconds:.2f} s, daemon {seen}"


def done_count(home: Path) -> int:
    try:
        return sum(job.state == "done" for job in read_jobs(home / "npumoed.db"))
    except (FileNotFoundError, OperationalError):
        return 0


def stop(daemon: Any) -> int:
    daemon.process.send_signal(signal.SIGTERM)
    return daemon.process.wait(timeout=120)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_documents_dropped_at_once_or_while_stopped_are_each_processed_exactly_once(
    home: Path,
    tmp_path: Path,
    daemon_config: Callable[..., Path],
    start_npumoed: Callable[..., Any],
    npumoed: Callable[..., subprocess.CompletedProcess[str]],
    wait_for: Callable[..., bool],
    chaos_figures: Figures,
) -> None:
    daemon_config(originals="move", summary_tokens=2, background=True)
    inbox, staging = home / "inbox", tmp_path / "staging"
    inbox.mkdir(parents=True)
    staging.mkdir()
    dropped = documents.write(staging, range(AT_ONCE), words=TINY)

    with StatusSampler(npumoed) as sampler:
        daemon = start_npumoed("run")
        assert wait_for(lambda: (home / "npumoed.db").exists(), timeout=120), daemon.output()
        for name in dropped.values():  # renames on one file system: a thousand complete files, all at once
            os.rename(staging / name, inbox / name)
        assert wait_for(lambda: done_count(home) == AT_ONCE, timeout=1800, interval=1.0), daemon.output()
        assert stop(daemon) == 0, daemon.output()

        dropped |= documents.write(inbox, range(AT_ONCE, AT_ONCE + WHILE_STOPPED), words=TINY)
        daemon = start_npumoed("run")
        assert wait_for(lambda: done_count(home) == AT_ONCE + WHILE_STOPPED, timeout=600, interval=1.0), (
            daemon.output()
        )
        assert stop(daemon) == 0, daemon.output()

    result = audit(home, dropped, originals_moved=True)
    once = sum(job.attempts == 1 for job in result.jobs)
    chaos_figures.add(
        f"load: {AT_ONCE} at once + {WHILE_STOPPED} while stopped, {sampler.slowest}",
        processed=result.processed,
        duplicates=len(result.duplicates) + (len(result.jobs) - once),  # a second attempt is processing twice
        losses=len(result.losses),
        status_seconds=sampler.seconds,
    )
    assert result.clean, result.problems()
    assert result.processed == len(dropped) == once == AT_ONCE + WHILE_STOPPED
    assert sampler.errors == [] and sampler.seconds
