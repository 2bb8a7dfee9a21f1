"""Overnight batch: the window a batch job waits for, and the report written when a window closes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, time, timedelta
from pathlib import Path
from typing import Any

from npumoe.jobs.meta import read_meta
from npumoe.jobs.outputs import write_file
from npumoe.jobs.queue.schema import STATES
from npumoe.jobs.queue.store import Job, Queue

from .config import WINDOW
from .home import Home


@dataclass(frozen=True)
class BatchWindow:
    """A daily local-time window; one that ends before it starts crosses midnight (22:00-06:00).

    Equal ends (00:00-00:00) mean the whole day.
    """

    start: time
    end: time

    @classmethod
    def parse(cls, text: str) -> BatchWindow:
        if not WINDOW.match(text):
            raise ValueError(f"batch window {text!r} must look like HH:MM-HH:MM, e.g. 01:00-06:00")
        start, end = text.split("-")
        return cls(time.fromisoformat(start), time.fromisoformat(end))

    def __str__(self) -> str:
        return f"{self.start:%H:%M}-{self.end:%H:%M}"

    def contains(self, now: datetime) -> bool:
        t = now.time()
        if self.start < self.end:
            return self.start <= t < self.end
        if self.start > self.end:
            return t >= self.start or t < self.end
        return True

    def last_opening(self, now: datetime) -> datetime:
        """When the window last opened, at or before `now`."""
        opening = now.replace(hour=self.start.hour, minute=self.start.minute, second=0, microsecond=0)
        return opening if opening <= now else opening - timedelta(days=1)


def write_batch_report(queue: Queue, home: Home, window: str, started: datetime, ended: datetime) -> Path:
    """Write reports/batch-<date>-<window>.json for the jobs of `window` between `started` and `ended`.

    It covers the jobs queued for that window that finished while it was open, and those still
    waiting for it. Tokens, CPU seconds and energy come from each finished job's meta.json; energy is
    summed over the jobs that measured it and reported as unavailable when none did.
    """
    since, until = started.timestamp(), ended.timestamp()
    covered = [job for job in queue.list() if job.batch_window == window
               and (job.finished_at is None or since <= job.finished_at <= until)]
    documents = [_document(job) for job in covered]
    measured = [d["energy_joules"] for d in documents if d["energy_joules"] is not None]
    report = {
        "window": window,
        "started": started.isoformat(timespec="seconds"),
        "ended": ended.isoformat(timespec="seconds"),
        "counts": {state: sum(d["state"] == state for d in documents) for state in STATES},
        "tokens": sum(d["tokens"] or 0 for d in documents),
        "cpu_seconds": round(sum(d["cpu_seconds"] or 0.0 for d in documents), 3),
        "energy_joules": round(sum(measured), 3) if measured else None,
        "energy_measured_documents": len(measured),
        "documents": documents,
    }
    path = home.reports / f"batch-{started:%Y%m%d}-{window.replace(':', '')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(path, (json.dumps(report, indent=2) + "\n").encode("utf-8"))
    return path


def _document(job: Job) -> dict[str, Any]:
    meta = job_meta(job)
    return {"id": job.id, "path": job.path, "state": job.state, "tokens": meta.get("tokens"),
            "cpu_seconds": meta.get("cpu_seconds"), "energy_joules": meta.get("energy_joules"),
            "output_dir": job.output_dir, "last_error": job.last_error}


def job_meta(job: Job) -> dict[str, Any]:
    """A finished job's meta.json (tokens, cpu_seconds, energy_joules, ...); {} when there is none or it is
    unreadable."""
    if not job.output_dir:
        return {}
    try:
        return read_meta(Path(job.output_dir))
    except ValueError:
        return {}
