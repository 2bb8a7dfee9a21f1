"""A durable job queue on SQLite: one table, six states, one statement that claims a job.

    queued ──claim──► running ──complete──► done
      ▲                  │ fail ──► failed (run_after = now + backoff) ──claim──► running …
      │                  │ fail, attempts used up ──► dead
      └── release/reap ──┘ cancel ──► cancelled          retry: failed/dead/cancelled ──► queued

Every write runs in `BEGIN IMMEDIATE`, so two claimers serialise on SQLite's write lock instead of
both reading the same row. No transaction stays open while a job is worked on: the worker holds a
lease, renews it with `heartbeat`, and `reap` returns the jobs of workers that died.
"""

from __future__ import annotations

import json
import random
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psutil
from sqlalchemy import Connection, Engine, Select, create_engine, event, func, insert, select, update
from sqlalchemy.exc import DatabaseError
from sqlalchemy.pool import QueuePool

from npumoe.jobs.errors import DatabaseUnusable
from npumoe.jobs.schema import STATES, check_integrity, control, daemon, jobs, migrate

CLAIMABLE = ("queued", "failed")
INTERACTIVE, BATCH = 10, 0  # priorities: a document added by hand outranks overnight batch work
MIN_SQLITE = (3, 35, 0)  # UPDATE … RETURNING
DAMAGED = ("SQLITE_CORRUPT", "SQLITE_NOTADB")  # "database disk image is malformed", "file is not a database"


@dataclass(frozen=True)
class Job:
    id: int
    path: str
    sha256: str
    model_key: str
    settings_key: str
    state: str
    priority: int
    attempts: int
    max_attempts: int
    run_after: float
    lease_until: float | None
    heartbeat_at: float | None
    worker_pid: int | None
    progress: float
    last_error: str | None
    created_at: float
    updated_at: float
    finished_at: float | None
    output_dir: str | None
    error_kind: str | None
    detail: str | None
    batch_window: str | None

    @classmethod
    def from_row(cls, row: Any) -> Job:
        m = row._mapping
        return cls(**{f.name: m[f.name] for f in fields(cls)})

    def as_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["detail"] = json.loads(self.detail) if self.detail else None
        return d


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with full jitter on the upper half: base·2^(n-1)·U(0.5, 1], capped."""

    base: float = 30.0
    cap: float = 3600.0

    def delay(self, attempts: int) -> float:
        return min(self.cap, self.base * 2 ** max(attempts - 1, 0)) * (0.5 + random.random() / 2)


def pid_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def damage(error: DatabaseError) -> DatabaseUnusable | None:
    """The error as DatabaseUnusable when SQLite found the file damaged; None for any other database error."""
    if getattr(error.orig, "sqlite_errorname", "") in DAMAGED:
        return DatabaseUnusable(f"the database is damaged ({error.orig})")
    return None


def check_sqlite_version(version: tuple[int, int, int] = sqlite3.sqlite_version_info) -> None:
    if version < MIN_SQLITE:
        raise DatabaseUnusable(f"SQLite {'.'.join(map(str, version))} is too old: npumoed needs "
                               f"{'.'.join(map(str, MIN_SQLITE))} or newer (a Python built with a newer SQLite)")


def _engine(path: Path, *, immediate: bool, read_only: bool = False) -> Engine:
    # A URI with the path quoted: a home may contain `#`, `?` or `%`, which a URL would read as its own syntax.
    uri = f"file:{quote(str(path.absolute()))}" + ("?mode=ro" if read_only else "")

    def connect() -> sqlite3.Connection:
        return sqlite3.connect(uri, uri=True, timeout=30, check_same_thread=False)

    # Pooled, not reopened per statement: closing SQLite's last connection checkpoints the WAL and removes
    # its files, so a daemon that only reads would still write to disk every few seconds.
    engine = create_engine("sqlite://", creator=connect, poolclass=QueuePool)

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, _: Any) -> None:
        dbapi_conn.isolation_level = None  # pysqlite's own BEGIN would defer the lock; we issue ours
        if not read_only:
            dbapi_conn.execute("PRAGMA journal_mode=WAL")
            dbapi_conn.execute("PRAGMA synchronous=NORMAL")
        dbapi_conn.execute("PRAGMA busy_timeout=30000")

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


def _runnable(now: float, open_windows: Sequence[str]) -> Select[tuple[int]]:
    """The jobs `claim` may take now: waiting, past their backoff, and outside a batch window or inside an open one."""
    return select(jobs.c.id).where(
        jobs.c.state.in_(CLAIMABLE), jobs.c.run_after <= now,
        jobs.c.batch_window.is_(None) | jobs.c.batch_window.in_(list(open_windows)))


class Queue:
    """The queue API: the worker loop and the CLI never write SQL of their own."""

    def __init__(self, path: Path, *, read_only: bool = False, backoff: Backoff = Backoff(),
                 clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.backoff = backoff
        self.clock = clock
        if read_only:
            if not self.path.exists():
                raise FileNotFoundError(f"no queue database at {self.path}")
            self._write = None
            self._read = _engine(self.path, immediate=False, read_only=True)
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.path.exists():
            self.path.touch(mode=0o600)
        check_sqlite_version()
        self._write = _engine(self.path, immediate=True)
        self._read = _engine(self.path, immediate=False)
        try:
            with self._tx() as conn:
                check_integrity(conn)
                migrate(conn)
        except DatabaseError as e:
            self.close()
            if problem := damage(e):
                raise problem from e
            raise
        except DatabaseUnusable:
            self.close()
            raise

    @contextmanager
    def _tx(self) -> Iterator[Connection]:
        if self._write is None:
            raise PermissionError("this queue was opened read-only")
        with self._write.begin() as conn:
            yield conn

    def close(self) -> None:
        for engine in (self._write, self._read):
            if engine is not None:
                engine.dispose()

    # -- adding ---------------------------------------------------------------------------------

    def add(self, path: str | Path, sha256: str, *, model_key: str, settings_key: str,
            priority: int = INTERACTIVE, max_attempts: int = 3,
            batch_window: str | None = None) -> tuple[Job, bool]:
        """Queue a document; the same content with the same model and settings is one job.

        Returns the job and whether it was created (False: it already existed, and is left as it is).
        """
        now = self.clock()
        with self._tx() as conn:
            row = conn.execute(
                insert(jobs)
                .values(path=str(path), sha256=sha256, model_key=model_key, settings_key=settings_key,
                        state="queued", priority=priority, attempts=0, max_attempts=max_attempts,
                        run_after=now, progress=0.0, created_at=now, updated_at=now,
                        batch_window=batch_window)
                .prefix_with("OR IGNORE")
                .returning(*jobs.c)
            ).first()
            if row is not None:
                return Job.from_row(row), True
            existing = conn.execute(
                select(jobs).where(jobs.c.sha256 == sha256, jobs.c.model_key == model_key,
                                   jobs.c.settings_key == settings_key)
            ).one()
            return Job.from_row(existing), False

    def record_done(self, job_id: int, path: str, sha256: str, *, model_key: str, settings_key: str,
                    output_dir: str, finished_at: float) -> bool:
        """Record a job finished elsewhere (rebuilding the queue from the outbox); False if its id or its
        content under those keys is known already."""
        with self._tx() as conn:
            return conn.execute(
                insert(jobs).prefix_with("OR IGNORE")
                .values(id=job_id, path=path, sha256=sha256, model_key=model_key, settings_key=settings_key,
                        state="done", priority=INTERACTIVE, attempts=1, max_attempts=1, run_after=finished_at,
                        progress=1.0, created_at=finished_at, updated_at=finished_at, finished_at=finished_at,
                        output_dir=output_dir)
            ).rowcount == 1

    # -- the worker's side ------------------------------------------------------------------------

    def claim(self, worker_pid: int, *, lease_seconds: float,
              open_windows: Sequence[str] = ()) -> Job | None:
        """Take the most urgent runnable job, or None. Batch jobs run only while their window is open."""
        now = self.clock()
        runnable = (
            _runnable(now, open_windows)
            .order_by(jobs.c.priority.desc(), jobs.c.run_after, jobs.c.id)
            .limit(1)
            .scalar_subquery()
        )
        with self._tx() as conn:
            row = conn.execute(
                update(jobs)
                .where(jobs.c.id == runnable)
                .values(state="running", attempts=jobs.c.attempts + 1, worker_pid=worker_pid,
                        lease_until=now + lease_seconds, heartbeat_at=now, updated_at=now, progress=0.0,
                        detail=None)
                .returning(*jobs.c)
            ).first()
        return Job.from_row(row) if row else None

    def heartbeat(self, job_id: int, worker_pid: int, *, lease_seconds: float,
                  progress: float | None = None, detail: dict[str, Any] | None = None) -> bool:
        """Renew the lease (and record progress). False: the job is no longer this worker's."""
        now = self.clock()
        values: dict[str, Any] = {"lease_until": now + lease_seconds, "heartbeat_at": now, "updated_at": now}
        if progress is not None:
            values["progress"] = progress
        if detail is not None:
            values["detail"] = json.dumps(detail)
        with self._tx() as conn:
            updated = conn.execute(update(jobs).where(*self._owned(job_id, worker_pid)).values(**values))
        return updated.rowcount == 1

    def complete(self, job_id: int, worker_pid: int, *, output_dir: str | None = None) -> bool:
        now = self.clock()
        with self._tx() as conn:
            return conn.execute(
                update(jobs).where(*self._owned(job_id, worker_pid))
                .values(state="done", progress=1.0, output_dir=output_dir, finished_at=now, updated_at=now,
                        lease_until=None, last_error=None, error_kind=None)
            ).rowcount == 1

    def fail(self, job_id: int, worker_pid: int, error: str, *, kind: str = "error",
             retryable: bool = True) -> str | None:
        """Record a failure: back off and retry while attempts remain, else dead. Returns the new state."""
        now = self.clock()
        with self._tx() as conn:
            job = conn.execute(select(jobs).where(*self._owned(job_id, worker_pid))).first()
            if job is None:
                return None
            retry = retryable and job.attempts < job.max_attempts
            state = "failed" if retry else "dead"
            conn.execute(
                update(jobs).where(jobs.c.id == job_id)
                .values(state=state, last_error=error, error_kind=kind, updated_at=now, lease_until=None,
                        worker_pid=None, finished_at=None if retry else now,
                        run_after=now + self.backoff.delay(job.attempts) if retry else job.run_after)
            )
            return state

    def release(self, job_id: int, worker_pid: int) -> bool:
        """Hand a job back untouched (graceful shutdown): queued again, the attempt not counted."""
        now = self.clock()
        with self._tx() as conn:
            return conn.execute(
                update(jobs).where(*self._owned(job_id, worker_pid))
                .values(state="queued", attempts=jobs.c.attempts - 1, worker_pid=None, lease_until=None,
                        progress=0.0, detail=None, updated_at=now)
            ).rowcount == 1

    def reap(self, alive: Callable[[int], bool] = pid_alive) -> list[int]:
        """Requeue the jobs of lost workers (lease expired or pid gone); dead once out of attempts."""
        now = self.clock()
        with self._tx() as conn:
            running = conn.execute(select(jobs).where(jobs.c.state == "running")).all()
            lost = [j for j in running
                    if (j.lease_until is not None and j.lease_until < now)
                    or j.worker_pid is None or not alive(j.worker_pid)]
            for j in lost:
                out_of_attempts = j.attempts >= j.max_attempts
                conn.execute(
                    update(jobs).where(jobs.c.id == j.id)
                    .values(state="dead" if out_of_attempts else "queued", worker_pid=None, lease_until=None,
                            updated_at=now, finished_at=now if out_of_attempts else None,
                            error_kind="lost", last_error=f"worker {j.worker_pid} stopped during attempt "
                                                          f"{j.attempts} (lease expired or process gone)")
                )
        return [j.id for j in lost]

    @staticmethod
    def _owned(job_id: int, worker_pid: int) -> tuple[Any, ...]:
        return jobs.c.id == job_id, jobs.c.state == "running", jobs.c.worker_pid == worker_pid

    # -- the person's side ------------------------------------------------------------------------

    def retry(self, job_id: int) -> Job:
        """Queue a failed, dead or cancelled job again now, with its attempts reset."""
        return self._set_state(job_id, "queued", ("failed", "dead", "cancelled"),
                               attempts=0, run_after=self.clock(), finished_at=None)

    def cancel(self, job_id: int) -> Job:
        """Cancel a waiting or running job; a running worker notices at its next heartbeat."""
        return self._set_state(job_id, "cancelled", ("queued", "failed", "running"),
                               finished_at=self.clock(), lease_until=None)

    def _set_state(self, job_id: int, state: str, allowed: tuple[str, ...], **values: Any) -> Job:
        with self._tx() as conn:
            job = conn.execute(select(jobs).where(jobs.c.id == job_id)).first()
            if job is None:
                raise KeyError(f"no job {job_id}")
            if job.state not in allowed:
                allowed_text = ', '.join(allowed)
                raise ValueError(f"job {job_id} is {job.state}; only {allowed_text} jobs can be {state}")
            row = conn.execute(update(jobs).where(jobs.c.id == job_id).returning(*jobs.c)
                               .values(state=state, updated_at=self.clock(), **values)).one()
        return Job.from_row(row)

    # -- reading ----------------------------------------------------------------------------------

    def get(self, job_id: int) -> Job | None:
        with self._read.connect() as conn:
            row = conn.execute(select(jobs).where(jobs.c.id == job_id)).first()
        return Job.from_row(row) if row else None

    def list(self, state: str | None = None, limit: int | None = None, *,
             newest_first: bool = False) -> list[Job]:
        if state is not None and state not in STATES:
            raise ValueError(f"unknown state {state!r} (states: {', '.join(STATES)})")
        query = select(jobs)
        if state is not None:
            query = query.where(jobs.c.state == state)
        order = jobs.c.updated_at.desc() if newest_first else jobs.c.id
        with self._read.connect() as conn:
            return [Job.from_row(r) for r in conn.execute(query.order_by(order).limit(limit))]

    def counts(self) -> dict[str, int]:
        with self._read.connect() as conn:
            found = dict(conn.execute(select(jobs.c.state, func.count()).group_by(jobs.c.state)).all())
        return {state: found.get(state, 0) for state in STATES}

    def has_runnable(self, open_windows: Sequence[str] = ()) -> bool:
        """Whether `claim` would find a job now; a read, so an idle daemon can ask without writing."""
        with self._read.connect() as conn:
            return conn.execute(_runnable(self.clock(), open_windows).limit(1)).first() is not None

    def open_windows_needed(self) -> list[str]:
        """The batch windows that waiting jobs are held for."""
        with self._read.connect() as conn:
            return list(conn.execute(
                select(jobs.c.batch_window).distinct()
                .where(jobs.c.state.in_(CLAIMABLE), jobs.c.batch_window.is_not(None))
            ).scalars())

    # -- the daemon's heartbeat row and the person's switches ------------------------------------

    def write_daemon(self, **values: Any) -> None:
        for key in ("power", "counters"):
            if key in values and not isinstance(values[key], str | None):
                values[key] = json.dumps(values[key])
        with self._tx() as conn:
            if conn.execute(update(daemon).where(daemon.c.id == 1).values(**values)).rowcount == 0:
                conn.execute(insert(daemon).values(id=1, **values))

    def read_daemon(self) -> dict[str, Any] | None:
        with self._read.connect() as conn:
            row = conn.execute(select(daemon).where(daemon.c.id == 1)).first()
        if row is None:
            return None
        d = dict(row._mapping)
        for key in ("power", "counters"):
            d[key] = json.loads(d[key]) if d[key] else None
        return d

    def set_control(self, key: str, value: Any) -> None:
        with self._tx() as conn:
            encoded = json.dumps(value)
            if conn.execute(update(control).where(control.c.key == key).values(value=encoded)).rowcount == 0:
                conn.execute(insert(control).values(key=key, value=encoded))

    def get_control(self, key: str, default: Any = None) -> Any:
        with self._read.connect() as conn:
            value = conn.execute(select(control.c.value).where(control.c.key == key)).scalar()
        return json.loads(value) if value is not None else default
