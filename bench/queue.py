"""Many processes draining one queue: the check that no job is claimed twice or lost, and its speed."""

from __future__ import annotations

import multiprocessing
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from npumoe.jobs.queue import Queue


def drain(database: Path, lease_seconds: float = 60.0) -> tuple[list[int], float, float]:
    """Claim and complete jobs until none is left: the ids this process claimed, its start and end."""
    queue = Queue(database)
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


def run_claim_benchmark(database: Path, *, processes: int = 4, jobs: int = 2000) -> ClaimRun:
    """Fill a fresh queue with `jobs` jobs, drain it with `processes` OS processes, count the outcome."""
    queue = Queue(database)
    for i in range(jobs):
        queue.add(f"/bench/{i}", f"{i:064x}", model_key="bench", settings_key="bench")
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        drained = pool.map(drain, [database] * processes)
    results = [ids for ids, _, _ in drained]
    seconds = max(end for _, _, end in drained) - min(start for _, start, _ in drained)
    seen = Counter(job_id for ids in results for job_id in ids)
    done = queue.counts()["done"]
    queue.close()
    return ClaimRun(processes=processes, jobs=jobs, seconds=seconds,
                    duplicates=sum(n - 1 for n in seen.values() if n > 1),
                    lost=jobs - done, per_process=[len(ids) for ids in results])
