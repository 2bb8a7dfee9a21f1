"""Rebuilding the queue's list of finished documents from the outbox, after the database was lost.

Each finished document left `outbox/<stem>-<key16>/meta.json`, naming its source, content hash, job and the
settings it was made with: enough to record it as done again, so that the inbox rescan settles its original
instead of processing it a second time. Waiting and failed jobs left nothing in the outbox; the rescan
queues their files again. A database that cannot be used is moved aside, never deleted.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from npumoe.engine.vocabulary import AUTO, DTYPE_WEIGHTS
from npumoe.jobs.errors import DatabaseUnusable
from npumoe.jobs.meta import read_meta
from npumoe.jobs.outputs import META_FILE, TMP_PREFIX
from npumoe.jobs.queue.store import Queue

from .config import Config
from .home import Home, outbox_folder
from .intake import job_keys
from .model_choice import DEMO, demo_model_dir


@dataclass
class Rebuilt:
    moved_aside: list[Path] = field(default_factory=list)  # the unusable database's files, under their new names
    restored: int = 0  # done jobs recorded again
    known: int = 0  # already in the queue
    skipped: list[str] = field(default_factory=list)  # "folder: why" for each output that could not be read


def rebuild_queue(home: Home, config: Config, *, stamp: str | None = None) -> Rebuilt:
    """Record every finished document in the outbox as done; an unusable database is first moved aside."""
    rebuilt = Rebuilt()
    try:
        Queue(home.database).close()
    except DatabaseUnusable:
        rebuilt.moved_aside = move_aside(home.database, stamp or time.strftime("%Y%m%d-%H%M%S"))
    try:
        current: tuple[str, str] | None = job_keys(config)
    except (OSError, ValueError):  # the configured plan is missing: no output matches today's settings
        current = None
    queue = Queue(home.database)
    try:
        for meta_path in sorted(outbox_folder(config, home).glob(f"*/{META_FILE}")):
            folder = meta_path.parent
            if folder.name.startswith(TMP_PREFIX):
                continue  # a writer's leftover, never a finished output
            try:
                meta = read_meta(folder)
            except ValueError as e:
                rebuilt.skipped.append(f"{folder}: {e}")
                continue
            model_key, settings_key = keys_of(meta, home, config, current)
            finished = datetime.fromisoformat(meta["created_at"]).timestamp()
            if queue.record_done(meta["job_id"], meta["source"], meta["sha256"], model_key=model_key,
                                 settings_key=settings_key, output_dir=str(folder), finished_at=finished):
                rebuilt.restored += 1
            else:
                rebuilt.known += 1
    finally:
        queue.close()
    return rebuilt


def move_aside(database: Path, stamp: str) -> list[Path]:
    """`npumoed.db` and its `-wal` and `-shm` renamed to `npumoed.db.damaged-<stamp>…`; returns the new names."""
    moved = []
    for suffix in ("", "-wal", "-shm"):
        path = database.with_name(database.name + suffix)
        if path.exists():
            target = database.with_name(f"{database.name}.damaged-{stamp}{suffix}")
            path.rename(target)
            moved.append(target)
    return moved


def keys_of(meta: dict[str, Any], home: Home, config: Config,
            current: tuple[str, str] | None) -> tuple[str, str]:
    """The (model_key, settings_key) the output was made under: today's keys when meta.json shows today's
    model, backend, plan, overflow and weights (it does not record the summary or section length), else keys
    of its own that no document queued today matches, so such a document is processed again under today's
    settings."""
    model_key = DEMO if Path(meta["model"]) == demo_model_dir() else meta["model"]
    m = config.model
    plan = str(Path(m.plan).expanduser()) if m.plan else None
    made_in = meta.get("weights") or DTYPE_WEIGHTS[meta["dtype"]]  # outputs from before weights: their dtype's
    made_as_today = (meta["backend"], meta["overflow"], meta["plan"]) == (m.backend, m.overflow, plan) and (
        m.weights in (AUTO, made_in))  # weights auto: whichever format the machine chose
    if current is not None and model_key == current[0] and made_as_today:
        return current
    settings = {name: meta[name] for name in ("backend", "plan", "overflow", "chunk_tokens")} | {"weights": made_in}
    return model_key, "rebuilt-" + hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
