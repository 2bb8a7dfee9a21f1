"""What a daemon's home says after a run: for every document dropped, how many results it got.

A document is processed exactly once when it has one done job, one output folder, that folder complete
(the three output files, its meta naming that job and that content) and, with `originals = "move"`, one
copy of itself in processed/. Anything else counts as a loss (no complete result) or a duplicate (more than
one). Temporary files anywhere in the home, jobs for content nobody dropped, and a database that fails
`PRAGMA integrity_check` are reported too.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from npumoe.jobs.outputs import OFFSETS_FILE, TEXT_FILE, TMP_PREFIX, output_name
from npumoe.jobs.queue.store import Job, Queue

OUTPUT_FILES = {"summary.md", "embeddings.npy", "meta.json", OFFSETS_FILE, TEXT_FILE}


@dataclass
class Audit:
    documents: int = 0
    processed: int = 0  # documents with exactly one complete result
    losses: list[str] = field(default_factory=list)  # "name: why"
    duplicates: list[str] = field(default_factory=list)
    strays: list[str] = field(default_factory=list)  # outputs or jobs that belong to no dropped document
    leftovers: list[str] = field(default_factory=list)  # temporary files anywhere in the home
    integrity: str = ""
    jobs: list[Job] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.losses or self.duplicates or self.strays or self.leftovers) and self.integrity == "ok"

    def problems(self) -> str:
        parts = {"lost": self.losses, "duplicated": self.duplicates, "stray": self.strays,
                 "left over": self.leftovers}
        lines = [f"{what}: {item}" for what, items in parts.items() for item in items[:20]]
        if self.integrity != "ok":
            lines.append(f"integrity_check: {self.integrity}")
        return "\n".join(lines)


def read_jobs(database: Path) -> list[Job]:
    """Every job, read the way `npumoed status` reads them (read-only, beside a running daemon)."""
    queue = Queue(database, read_only=True)
    try:
        return queue.list()
    finally:
        queue.close()


def integrity(database: Path) -> str:
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as conn:
        return "; ".join(row[0] for row in conn.execute("PRAGMA integrity_check"))


def audit(home: Path, dropped: dict[str, str], *, originals_moved: bool) -> Audit:
    """Check the home against `dropped` (sha256 -> file name) once the daemon has stopped."""
    result = Audit(documents=len(dropped), integrity=integrity(home / "npumoed.db"))
    result.jobs = read_jobs(home / "npumoed.db")
    done = Counter(job.sha256 for job in result.jobs if job.state == "done")
    by_sha = {job.sha256: job for job in result.jobs if job.state == "done"}
    expected_folders = output_folders(dropped, result.jobs)
    folders = Counter()
    for entry in (home / "outbox").iterdir():
        if entry.name in expected_folders:
            folders[expected_folders[entry.name]] += 1
        elif not entry.name.startswith(TMP_PREFIX):  # those are counted with the leftovers below
            result.strays.append(f"outbox/{entry.name}")
    moved = Counter(_sha256(p) for p in (home / "processed").iterdir()) if originals_moved else Counter()
    for job in result.jobs:
        if job.sha256 not in dropped:
            result.strays.append(f"job #{job.id} ({job.state}) for {job.path}")
    for sha, name in dropped.items():
        counts = {"done jobs": done[sha], "output folders": folders[sha]}
        if originals_moved:
            counts["originals in processed/"] = moved[sha]
        if any(n > 1 for n in counts.values()):
            result.duplicates.append(f"{name}: {counts}")
        elif any(n == 0 for n in counts.values()):
            states = [j.state for j in result.jobs if j.sha256 == sha]
            result.losses.append(f"{name}: {counts}, jobs {states}")
        elif why := incomplete(home / "outbox" / output_folder(name, by_sha[sha]), by_sha[sha]):
            result.losses.append(f"{name}: {why}")
        else:
            result.processed += 1
    result.leftovers = [str(p.relative_to(home)) for p in _walk(home) if p.name.startswith(TMP_PREFIX)]
    return result


def output_folder(name: str, job: Job) -> str:
    """The output folder's name the daemon gives the document `name` done as `job`."""
    return output_name(name, job.sha256, job.model_key, job.settings_key)


def output_folders(dropped: dict[str, str], jobs: list[Job]) -> dict[str, str]:
    """The output folder's name of each job of a `dropped` document (sha256 -> file name): folder -> sha256."""
    return {output_folder(dropped[job.sha256], job): job.sha256 for job in jobs if job.sha256 in dropped}


def incomplete(folder: Path, job: Job) -> str:
    """Why `folder` is not the complete output set of `job`; empty when it is."""
    names = {p.name for p in folder.iterdir()}
    if names != OUTPUT_FILES:
        return f"output folder holds {sorted(names)}"
    if job.output_dir != str(folder):
        return f"job #{job.id} points at {job.output_dir}, not {folder}"
    try:
        meta = json.loads((folder / "meta.json").read_bytes())
        rows = np.load(folder / "embeddings.npy").shape
    except ValueError as e:
        return f"unreadable output: {e}"
    if (meta.get("job_id"), meta.get("sha256")) != (job.id, job.sha256):
        return f"meta.json names job {meta.get('job_id')}, content {meta.get('sha256')}"
    if rows != (meta["chunks"] + 1, meta["embeddings"]["dim"]):
        return f"embeddings of shape {rows} for {meta['chunks']} chunks"
    if not (folder / "summary.md").read_text().startswith("# "):
        return "summary.md has no heading"
    return ""


def _walk(root: Path) -> list[Path]:
    found = []
    for folder, dirs, files in os.walk(root):
        found += [Path(folder) / name for name in dirs + files]
    return found


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
