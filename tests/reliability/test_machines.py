"""Several machines on one PostgreSQL queue: three daemons, SIGKILLed over and over, and the server restarted.

Three `npumoed run` processes, each with a home of its own (as three machines would have), share one real
PostgreSQL queue and one output folder (`[outbox] folder`, the storage all machines mount). A thousand short
documents on the shared storage are queued with `npumoed add` from one home while the daemons run. Whenever
another ~1/14 of the documents is done, one live daemon, drawn by a seeded generator, is SIGKILLed and
started again a moment later (what launchd or systemd would do); once, half-way, the PostgreSQL server is
stopped and started (a fast shutdown, which cuts every open session). When every job is done the daemons
are stopped gracefully and the shared outbox is audited: each document must have exactly one complete output
set whose meta names its done job and content, and nothing else may be in the outbox but leftovers of killed
writers (counted, reported).

The daemons run the tiny model on one-sentence documents in 64-token chunks with a two-token summary: the
whole product pipeline (watcher, queue, extraction child, engine, outputs), at a size two shared cores
can take a thousand of. All three share one hostname, so besides leases, the same-host pid check reaps a
killed daemon's job when any daemon starts. Set NPUMOED_CHAOS_SEED to replay another schedule.
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
from pathlib import Path
from typing import Any

import documents
import pytest
from chaos_summary import Figures
from daemon_toml import daemon_toml
from home_audit import incomplete, output_folders
from support.postgres_server import PostgresServer

from npumoe.jobs.outputs import TMP_PREFIX
from npumoe.jobs.queue.store import Job, Queue

DOCUMENTS = 1000
DAEMONS = 3
KILLS = 14  # one per 1/14 of the documents done; at least 10 must land before the queue drains
TINY = (3, 8)  # words per document
SEED = int(os.environ.get("NPUMOED_CHAOS_SEED", "18"))


class Machine:
    """One daemon's home and its `npumoed run` process, restarted after each kill."""

    def __init__(self, root: Path, name: str, config: str) -> None:
        self.name = name
        self.home = root / f"home-{name}"
        self.home.mkdir()
        (self.home / "config.toml").write_text(config)
        self.log = root / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.pids: list[int] = []  # one per start

    def npumoed(self, *args: str, **options: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "npumoe.daemon", *args], env=self._env(), capture_output=True,
                              text=True, **options)

    def start(self) -> None:
        with self.log.open("ab") as sink:
            self.process = subprocess.Popen([sys.executable, "-m", "npumoe.daemon", "run"], env=self._env(),
                                            stdout=sink, stderr=subprocess.STDOUT)
        self.pids.append(self.process.pid)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=60)

    def stop(self) -> int:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=120)

    def _env(self) -> dict[str, str]:
        return {**os.environ, "NPUMOED_HOME": str(self.home)}


def read_jobs(url: str) -> list[Job]:
    queue = Queue(url, read_only=True)
    try:
        return queue.list()
    finally:
        queue.close()


def audit_outbox(outbox: Path, homes: list[Path], dropped: dict[str, str], jobs: list[Job]) -> dict[str, Any]:
    """Count, from the output folders, how many complete results each document got."""
    done = {job.sha256: job for job in jobs if job.state == "done"}
    expected = output_folders(dropped, jobs)
    results: Counter[str] = Counter()
    problems, leftovers = [], []
    for folder in [outbox, *(home / "outbox" for home in homes)]:
        for entry in folder.iterdir():
            if entry.name.startswith(TMP_PREFIX):
                leftovers.append(str(entry))
            elif entry.name not in expected:
                problems.append(f"stray {entry}")
            elif expected[entry.name] not in done:
                problems.append(f"{entry}: its document has no done job")
            elif why := incomplete(entry, done[expected[entry.name]]):
                problems.append(f"{entry}: {why}")
            else:
                results[expected[entry.name]] += 1
    duplicates = [dropped[sha] for sha, n in results.items() if n > 1]
    losses = [name for sha, name in dropped.items() if results[sha] == 0]
    return {"processed": sum(n == 1 for n in results.values()), "duplicates": duplicates, "losses": losses,
            "problems": problems, "leftovers": leftovers}


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_three_machines_share_a_postgresql_queue_through_kills_and_a_server_restart(
    tmp_path: Path, tiny_model: Path, wait_for: Callable[..., bool], chaos_figures: Figures
) -> None:
    server = PostgresServer.start_new()
    try:
        _run(server, tmp_path, tiny_model, wait_for, chaos_figures)
    finally:
        server.close()


def _run(server: PostgresServer, root: Path, tiny_model: Path, wait_for: Callable[..., bool],
         chaos_figures: Figures) -> None:
    started = time.monotonic()
    url = server.new_database()
    shared_docs, shared_outbox = root / "shared" / "documents", root / "shared" / "outbox"
    shared_docs.mkdir(parents=True)
    model = f'name = "{tiny_model}"\nchunk_tokens = 64\nsummary_tokens = 2'
    config = daemon_toml(model, max_attempts=KILLS + 3, queue_url=url, outbox=str(shared_outbox))
    machines = [Machine(root, name, config) for name in "abc"[:DAEMONS]]
    rng = random.Random(SEED)
    dropped = documents.write(shared_docs, range(DOCUMENTS), words=TINY)

    def done() -> int:
        return sum(job.state == "done" for job in read_jobs(url))

    for machine in machines:
        machine.start()
    added = machines[0].npumoed("add", str(shared_docs), timeout=1200)  # from one machine, while all work
    assert added.returncode == 0, added.stderr[-2000:]

    kills, restarted_at, exits = 0, None, Counter()
    step = DOCUMENTS // KILLS
    while (finished := done()) < DOCUMENTS:
        for machine in machines:  # a daemon that stopped on its own is started again, and counted
            if not machine.alive():
                exits[machine.name] += 1
                machine.start()
        if restarted_at is None and finished >= DOCUMENTS // 2:
            server.restart(down_seconds=2.0)
            restarted_at = finished
        if kills < KILLS and finished >= (kills + 1) * step:
            victim = rng.choice(machines)
            victim.kill()
            kills += 1
            time.sleep(rng.uniform(0.0, 2.0))
            victim.start()
        time.sleep(0.5)
        assert time.monotonic() - started < 3300, f"{finished} of {DOCUMENTS} done before the time ran out"

    assert all(machine.stop() == 0 for machine in machines), [m.log.read_text()[-3000:] for m in machines]
    jobs = read_jobs(url)
    result = audit_outbox(shared_outbox, [m.home for m in machines], dropped, jobs)
    attempts = Counter(job.attempts for job in jobs)
    by_machine = Counter(next(m.name for m in machines if job.worker_pid in m.pids) for job in jobs)
    minutes = (time.monotonic() - started) / 60
    chaos_figures.add(
        f"machines: {DAEMONS} daemons on one PostgreSQL queue, seed {SEED}, server restarted at {restarted_at} done, "
        f"{sum(exits.values())} exits on their own, documents per daemon {dict(sorted(by_machine.items()))}, "
        f"attempts {dict(sorted(attempts.items()))}, "
        f"{len(result['leftovers'])} writer leftovers in the shared outbox, {minutes:.1f} min",
        kills=kills, processed=result["processed"], duplicates=len(result["duplicates"]),
        losses=len(result["losses"]),
    )
    assert kills >= 10 and restarted_at is not None
    assert result["problems"] == [] and result["duplicates"] == [] and result["losses"] == []
    assert result["processed"] == DOCUMENTS == sum(job.state == "done" for job in jobs) == len(jobs)
    assert all(by_machine[m.name] > 0 for m in machines) and not exits
