"""Faults of the machine among many documents, while the daemon is killed: nothing waits behind a bad file.

Three hundred documents go through the real daemon (faulty_npumoed.py) while it is SIGKILLed at seeded moments
and restarted, as in test_crash_consistency.py. One document's reads fail with EIO once it is queued (a bad
sector: the machine probes well, the file never reads), and the queue's database is found full while another
is being marked done. Every good document must be done exactly once, counted from the outputs; the unreadable
one must end dead and set aside with its reason, having cost its attempts only after its free hand-backs; and
documents must be completed while it was still being tried. The longest wait between two completions is
reported in the chaos summary line, not asserted (this machine's cores are shared).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path

import documents
import pytest
from chaos_summary import Figures
from home_audit import audit
from test_crash_consistency import MOMENTS, SEED, jobs_now, wait_for_moment

DOCUMENTS = 300
KILLS = 4
UNREADABLE, FILLS = 42, 150  # the document whose sector is bad, and the one whose completion meets a full database
TINY = (3, 8)  # words per document
HERE = Path(__file__).parent


class Daemon:
    """A faulty `npumoed run`, its output in `log`; what the crash test's moments wait on (`process.pid`)."""

    def __init__(self, home: Path, log: Path, names: tuple[str, str]) -> None:
        (home / "markers").mkdir(exist_ok=True)
        with log.open("ab") as sink:
            self.process = subprocess.Popen(
                [sys.executable, str(HERE / "faulty_npumoed.py"), *names, str(home / "markers"), "run"],
                stdout=sink, stderr=subprocess.STDOUT)
        self.log = log

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]


def settled(home: Path, good: set[str], bad: str) -> bool:
    jobs = jobs_now(home)
    return {j.sha256 for j in jobs if j.state == "done"} >= good and any(
        j.sha256 == bad and j.state == "dead" for j in jobs)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_a_bad_file_and_a_full_database_hold_up_no_other_document_while_the_daemon_is_killed(
    home: Path,
    tmp_path: Path,
    daemon_config: Callable[..., Path],
    wait_for: Callable[..., bool],
    chaos_figures: Figures,
) -> None:
    max_attempts = KILLS + 2  # the kills' attempts too, as in the crash test: none is given up for them
    daemon_config(originals="move", summary_tokens=2, max_attempts=max_attempts)
    (home / "inbox").mkdir(parents=True)
    dropped = documents.write(home / "inbox", range(DOCUMENTS), words=TINY)
    names = {name: sha for sha, name in dropped.items()}
    bad_name, fills_name = f"doc-{UNREADABLE:05d}.txt", f"doc-{FILLS:05d}.txt"
    bad = names[bad_name]
    good = {sha: name for sha, name in dropped.items() if sha != bad}
    rng = random.Random(SEED)
    moments: Counter[str] = Counter()
    first_hand_back: float | None = None

    for life in range(KILLS):
        daemon = Daemon(home, tmp_path / f"npumoed-{life}.log", (bad_name, fills_name))
        moment = rng.choices(list(MOMENTS), weights=list(MOMENTS.values()))[0]
        wait_for_moment(moment, rng, home, daemon.process.pid, dropped, wait_for)
        assert daemon.process.poll() is None, f"the daemon exited on its own:\n{daemon.output()}"
        os.kill(daemon.process.pid, signal.SIGKILL)
        daemon.process.wait(timeout=30)
        moments[moment] += 1

    last = Daemon(home, tmp_path / "npumoed-last.log", (bad_name, fills_name))

    def watch() -> bool:
        nonlocal first_hand_back
        if first_hand_back is None and any(j.sha256 == bad and j.error_kind == "machine" for j in jobs_now(home)):
            first_hand_back = time.time()
        return settled(home, set(good), bad)

    assert wait_for(watch, timeout=1800, interval=0.5), last.output()
    last.process.send_signal(signal.SIGTERM)
    assert last.process.wait(timeout=60) == 0, last.output()

    result = audit(home, good, originals_moved=True)
    jobs = {j.sha256: j for j in result.jobs}
    finished = sorted(j.finished_at for j in result.jobs if j.state == "done" and j.finished_at is not None)
    longest = max(b - a for a, b in pairwise(finished))
    dead = jobs[bad]
    chaos_figures.add(f"faulty files: seed {SEED}, {dict(moments)}, longest wait between completions {longest:.1f} s",
                      kills=sum(moments.values()), processed=result.processed, duplicates=len(result.duplicates),
                      losses=len(result.losses))
    print(f"\nfaulty files: {result.processed} of {len(good)} good documents done once, the unreadable one "
          f"{dead.state} after {dead.attempts} attempts; longest wait between completions {longest:.1f} s")
    assert [s for s in result.strays if s != f"job #{dead.id} ({dead.state}) for {dead.path}"] == []
    result.strays = []
    assert result.clean, result.problems()
    assert result.processed == len(good) == DOCUMENTS - 1
    assert (home / "markers" / "sector-bad").exists() and (home / "markers" / "database-filled").exists()
    assert (dead.state, dead.error_kind, dead.attempts) == ("dead", "machine", max_attempts)
    assert dead.last_error is not None and dead.last_error.startswith("I/O error in ")
    report = (home / "failed" / f"{bad_name}.error.txt").read_text()
    assert "kind: machine" in report and "I/O error" in report and not (home / "inbox" / bad_name).exists()
    # Not stalled behind it: while it was handed back and retried, other documents were completed.
    assert first_hand_back is not None and dead.finished_at is not None
    assert any(first_hand_back < t < dead.finished_at for t in finished)
