"""Many processes draining one queue: the check that no job is claimed twice or lost, and its speed.

The queue is a SQLite file, or a PostgreSQL server; on a server each run gets a schema of its own, dropped
afterwards, so a benchmark never touches the queue's real tables in that database.
"""

from __future__ import annotations

import multiprocessing
import os
import secrets
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import create_engine
from sqlalchemy.engine import make_url

from npumoe.jobs.queue.schema import DONE
from npumoe.jobs.queue.store import Queue


@contextmanager
def fresh_queue(url: str | None = None) -> Iterator[Path | str]:
    """Where an empty queue can be made: a file in a temporary folder, or a new schema on the server at `url`."""
    if url is None:
        with tempfile.TemporaryDirectory() as folder:
            yield Path(folder) / "queue.db"
        return
    schema = f"npumoed_bench_{secrets.token_hex(4)}"
    server = create_engine(make_url(url).set(drivername="postgresql+psycopg"), isolation_level="AUTOCOMMIT")
    try:
        with server.connect() as conn:
            conn.exec_driver_sql(f"CREATE SCHEMA {schema}")
        try:
            own = make_url(url).update_query_dict({"options": f"-csearch_path={schema}"})
            yield own.render_as_string(hide_password=False)
        finally:
            with server.connect() as conn:
                conn.exec_driver_sql(f"DROP SCHEMA {schema} CASCADE")
    finally:
        server.dispose()


def drain(location: Path | str, lease_seconds: float = 60.0) -> tuple[list[int], float, float]:
    """Claim and complete jobs until none is left: the ids this process claimed, its start and end."""
    queue = Queue(location)
    claimed = []
    start = time.time()  # wall clock, comparable across processes; process start-up is not counted
    try:
        while (job := queue.claim(os.getpid(), lease_seconds=lease_seconds)) is not None:
            claimed.append(job.id)
            queue.complete(job.id, os.getpid())
    finally:
        queue.close()
    return claimed, start, time.time()


@dataclass(frozen=True)
class ClaimRun:
    processes: int
    jobs: int
    seconds: float
    duplicates: int
    lost: int  # jobs that did not end done
    per_process: list[int]

    @property
    def jobs_per_second(self) -> float:
        return self.jobs / self.seconds


def run_claim_benchmark(location: Path | str, *, processes: int = 4, jobs: int = 2000) -> ClaimRun:
    """Fill a fresh queue with `jobs` jobs, drain it with `processes` OS processes, count the outcome."""
    queue = Queue(location)
    for i in range(jobs):
        queue.add(f"/bench/{i}", f"{i:064x}", model_key="bench", settings_key="bench")
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        drained = pool.map(drain, [location] * processes)
    results = [ids for ids, _, _ in drained]
    seconds = max(end for _, _, end in drained) - min(start for _, start, _ in drained)
    seen = Counter(job_id for ids in results for job_id in ids)
    done = queue.counts()[DONE]
    queue.close()
    return ClaimRun(processes=processes, jobs=jobs, seconds=seconds,
                    duplicates=sum(n - 1 for n in seen.values() if n > 1),
                    lost=jobs - done, per_process=[len(ids) for ids in results])
