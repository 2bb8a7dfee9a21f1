"""A durable job queue on SQLite or PostgreSQL: one table, six states, one statement that claims a job.

    queued ──claim──► running ──complete──► done
      ▲                  │ fail ──► failed (run_after = now + backoff) ──claim──► running …
      │                  │ fail, attempts used up ──► dead
      └── release/reap ──┘ cancel ──► cancelled          retry: failed/dead/cancelled ──► queued

On SQLite every write runs in `BEGIN IMMEDIATE`, so two claimers serialise on the write lock instead of
both reading the same row; on PostgreSQL the claim skips rows another transaction holds (`FOR UPDATE SKIP
LOCKED`), so workers on several machines never take the same job nor wait on each other. No transaction
stays open while a job is worked on: the worker holds a lease, renews it with `heartbeat`, and `reap`
returns the jobs of workers that died.

A worker is known by host, pid and process start time. Whether its process is alive can be asked only on
its own host; a job of a worker on another machine comes back when its lease expires. Leases and backoffs are
reckoned in the database's time (PostgreSQL's clock, not each machine's), and a statement run again after its
answer was lost (`reconnecting`) does what it did once: a claim finds the job it took by its claim token, a
complete finds the job done by the same worker.
"""

from __future__ import annotations

import json
import random
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import psutil
from sqlalchemy import Connection, Select, func, select, update

from ..errors import MISSING
from .controls import Controls
from .daemons import DaemonRows
from .database import Database, reconnecting
from .handed import HandedFiles
from .schema import CANCELLED, DEAD, DONE, FAILED, QUEUED, RUNNING, STATES, jobs

CLAIMABLE = (QUEUED, FAILED)
# A job handed back for a machine fault: the first few times it costs nothing and goes to the end of the line; the
# next few it also waits (backoff), so the other jobs go first; after that the fault keeps coming back while the
# machine probes well, so it is likely the file's (an unreadable sector): an attempt is spent.
FREE_HANDBACKS, HANDBACKS = 2, 4
INTERACTIVE, BATCH = 10, 0  # priorities: a document added by hand outranks overnight batch work


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
    worker_host: str | None
    worker_started: float | None
    pinned_host: str | None
    claim_token: str | None
    handbacks: int

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


def process_started(pid: int) -> float | None:
    """When process `pid` of this machine started; None when there is no such process."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _runnable(now: float, open_windows: Sequence[str], host: str) -> Select[tuple[int]]:
    """The jobs `claim` may take now on `host`: waiting, past their backoff, outside a batch window or inside an
    open one, and not pinned to another machine."""
    return select(jobs.c.id).where(
        jobs.c.state.in_(CLAIMABLE), jobs.c.run_after <= now,
        jobs.c.batch_window.is_(None) | jobs.c.batch_window.in_(list(open_windows)),
        jobs.c.pinned_host.is_(None) | (jobs.c.pinned_host == host))


def same_process(pid: int, started: float | None) -> bool:
    """Process `pid` is alive and is the one that started at `started` (not a later process given its pid)."""
    if not pid_alive(pid):
        return False
    now_started = process_started(pid)
    return started is None or now_started is None or abs(now_started - started) < 1.0


class Queue:
    """The queue API: the worker loop and the CLI never write SQL of their own.

    `location` is a SQLite file, or a `postgresql://…` URL for a queue that several machines share.
    `host` and `home` say which daemon this is, for its row in the daemon table. `clock`: the time the queue
    reckons in; by default the database's (`Dialect.now`), a fixed one for tests. The jobs are its methods;
    the watcher's memory of handed files (`handed`), the daemons' rows (`daemons`) and the person's switches
    (`controls`) are objects of their own on the same database, opened once with it.
    """

    def __init__(self, location: Path | str, *, read_only: bool = False, backoff: Backoff = Backoff(),
                 clock: Callable[[], float] | None = None, host: str | None = None,
                 home: Path | str | None = None) -> None:
        self.db = Database(location, read_only=read_only, host=host, home=home)
        self.path, self.location, self.host = self.db.path, self.db.location, self.db.host
        self.backoff = backoff
        self.clock = clock
        # The other concerns kept in the same database, on the same engines.
        self.handed = HandedFiles(self.db)
        self.daemons = DaemonRows(self.db)
        self.controls = Controls(self.db)

    @property
    def shared(self) -> bool:
        """Whether workers of other homes and machines may share this queue (PostgreSQL)."""
        return self.db.shared

    def now(self, conn: Connection) -> float:
        """The time now as the queue reckons it, read on `conn` (PostgreSQL: the server's clock)."""
        return self.clock() if self.clock is not None else self.db.dialect.now(conn)

    def close(self) -> None:
        self.db.close()

    def listen(self, wake: Callable[[], None], stop: threading.Event) -> threading.Thread | None:
        """Call `wake` whenever a job may have become claimable anywhere (PostgreSQL's NOTIFY), until `stop`.
        None on SQLite, where the only worker learns of new jobs from its own watcher or its next poll."""
        return self.db.dialect.listen(wake, stop)

    # -- adding ---------------------------------------------------------------------------------

    @reconnecting
    def add(self, path: str | Path, sha256: str, *, model_key: str, settings_key: str,
            priority: int = INTERACTIVE, max_attempts: int = 3,
            batch_window: str | None = None, pinned: bool = False) -> tuple[Job, bool]:
        """Queue a document; the same content with the same model and settings is one job, on every machine.

        `pinned`: the path is readable on this machine only (its own inbox), so on a shared queue only this
        host's worker may claim it. Returns the job and whether it was created (False: it already existed,
        and is left as it is).
        """
        with self.db.tx() as conn:
            now = self.now(conn)
            values = dict(path=str(path), sha256=sha256, model_key=model_key, settings_key=settings_key,
                          state=QUEUED, priority=priority, attempts=0, max_attempts=max_attempts, run_after=now,
                          progress=0.0, created_at=now, updated_at=now, batch_window=batch_window,
                          pinned_host=self.host if pinned and self.shared else None)
            row = conn.execute(self.db.dialect.insert_new(jobs, values).returning(*jobs.c)).first()
            if row is not None:
                self.db.dialect.notify(conn)
                return Job.from_row(row), True
            existing = conn.execute(
                select(jobs).where(jobs.c.sha256 == sha256, jobs.c.model_key == model_key,
                                   jobs.c.settings_key == settings_key)
            ).one()
            return Job.from_row(existing), False

    @reconnecting
    def follow(self, job_id: int, from_path: str, to_path: str | Path, *, pinned: bool = False) -> Job | None:
        """The job's content is now at `to_path` (its file renamed, or a copy while the first is gone): the job
        takes that path, unless it is running or its path is no longer `from_path` (someone else moved it first).
        A job that could not end well without it is queued again: a done one (the caller found its outputs gone)
        and one that died because its file was gone. Returns the job as it is now; None if left alone."""
        with self.db.tx() as conn:
            now = self.now(conn)
            job = conn.execute(select(jobs).where(jobs.c.id == job_id, jobs.c.path == from_path,
                                                  jobs.c.state != RUNNING).with_for_update()).first()
            if job is None:
                return None
            values: dict[str, Any] = dict(path=str(to_path), updated_at=now,
                                          pinned_host=self.host if pinned and self.shared else job.pinned_host)
            if job.state == DONE or (job.state == DEAD and job.error_kind == MISSING):
                values |= dict(state=QUEUED, attempts=0, handbacks=0, run_after=now, finished_at=None)
            row = conn.execute(update(jobs).where(jobs.c.id == job_id).values(**values).returning(*jobs.c)).one()
            if row.state in CLAIMABLE:
                self.db.dialect.notify(conn)
        return Job.from_row(row)

    def record_done(self, job_id: int, path: str, sha256: str, *, model_key: str, settings_key: str,
                    output_dir: str, finished_at: float) -> bool:
        """Record a job finished elsewhere (rebuilding the queue from the outbox); False if its id or its
        content under those keys is known already."""
        values = dict(id=job_id, path=path, sha256=sha256, model_key=model_key, settings_key=settings_key,
                      state=DONE, priority=INTERACTIVE, attempts=1, max_attempts=1, run_after=finished_at,
                      progress=1.0, created_at=finished_at, updated_at=finished_at, finished_at=finished_at,
                      output_dir=output_dir)
        with self.db.tx() as conn:
            return conn.execute(self.db.dialect.insert_new(jobs, values)).rowcount == 1

    # -- the worker's side ------------------------------------------------------------------------

    def claim(self, worker_pid: int, *, lease_seconds: float,
              open_windows: Sequence[str] = ()) -> Job | None:
        """Take the most urgent runnable job, or None. Batch jobs run only while their window is open.
        IdentityInUse while another live daemon has this one's identity (see Database.hold_identity)."""
        self.db.hold_identity()
        # One token per call, not per try: a try run again after its commit's answer was lost finds its job.
        return self._claim(uuid.uuid4().hex, worker_pid, lease_seconds, open_windows)

    @reconnecting
    def _claim(self, token: str, worker_pid: int, lease_seconds: float, open_windows: Sequence[str]) -> Job | None:
        with self.db.tx() as conn:
            taken = conn.execute(select(jobs).where(jobs.c.claim_token == token, jobs.c.state == RUNNING)).first()
            if taken is not None:
                return Job.from_row(taken)
            now = self.now(conn)
            runnable = (
                _runnable(now, open_windows, self.host)
                .order_by(jobs.c.priority.desc(), jobs.c.run_after, jobs.c.id)
                .limit(1)
                .with_for_update(skip_locked=True)  # PostgreSQL: pass over rows other claimers hold
                .scalar_subquery()
            )
            row = conn.execute(
                update(jobs)
                .where(jobs.c.id == runnable)
                .values(state=RUNNING, attempts=jobs.c.attempts + 1, worker_pid=worker_pid,
                        worker_host=self.host, worker_started=process_started(worker_pid), claim_token=token,
                        lease_until=now + lease_seconds, heartbeat_at=now, updated_at=now, progress=0.0,
                        detail=None)
                .returning(*jobs.c)
            ).first()
        return Job.from_row(row) if row else None

    @reconnecting
    def heartbeat(self, job_id: int, worker_pid: int, *, lease_seconds: float,
                  progress: float | None = None, detail: dict[str, Any] | None = None) -> bool:
        """Renew the lease (and record progress). False: the job is no longer this worker's."""
        with self.db.tx() as conn:
            now = self.now(conn)
            values: dict[str, Any] = {"lease_until": now + lease_seconds, "heartbeat_at": now, "updated_at": now}
            if progress is not None:
                values["progress"] = progress
            if detail is not None:
                values["detail"] = json.dumps(detail)
            updated = conn.execute(update(jobs).where(*self._owned(job_id, worker_pid)).values(**values))
        return updated.rowcount == 1

    @reconnecting
    def complete(self, job_id: int, worker_pid: int, *, output_dir: str | None = None) -> bool:
        """Mark the job done. False: it is no longer this worker's; True also when this worker already completed
        it (the same statement run again after its answer was lost)."""
        with self.db.tx() as conn:
            now = self.now(conn)
            done = conn.execute(
                update(jobs).where(*self._owned(job_id, worker_pid))
                .values(state=DONE, progress=1.0, output_dir=output_dir, finished_at=now, updated_at=now,
                        lease_until=None, last_error=None, error_kind=None, handbacks=0)
            ).rowcount == 1
            if not done:
                done = conn.execute(select(jobs.c.id).where(
                    jobs.c.id == job_id, jobs.c.state == DONE, jobs.c.worker_pid == worker_pid,
                    jobs.c.worker_host == self.host, jobs.c.output_dir == output_dir)).first() is not None
            return done

    @reconnecting
    def fail(self, job_id: int, worker_pid: int, error: str, *, kind: str = "error",
             retryable: bool = True) -> str | None:
        """Record a failure: back off and retry while attempts remain, else dead. Returns the new state."""
        with self.db.tx() as conn:
            now = self.now(conn)
            job = conn.execute(select(jobs).where(*self._owned(job_id, worker_pid)).with_for_update()).first()
            if job is None:
                return None
            retry = retryable and job.attempts < job.max_attempts
            state = FAILED if retry else DEAD
            conn.execute(
                update(jobs).where(jobs.c.id == job_id)
                .values(state=state, last_error=error, error_kind=kind, updated_at=now, lease_until=None,
                        worker_pid=None, finished_at=None if retry else now,
                        run_after=now + self.backoff.delay(job.attempts) if retry else job.run_after)
            )
            return state

    @reconnecting
    def release(self, job_id: int, worker_pid: int) -> bool:
        """Hand a job back untouched (graceful shutdown): queued again, the attempt not counted."""
        with self.db.tx() as conn:
            released = conn.execute(
                update(jobs).where(*self._owned(job_id, worker_pid))
                .values(state=QUEUED, attempts=jobs.c.attempts - 1, worker_pid=None, lease_until=None,
                        progress=0.0, detail=None, updated_at=self.now(conn))
            ).rowcount == 1
            if released:
                self.db.dialect.notify(conn)
            return released

    @reconnecting
    def hand_back(self, job_id: int, worker_pid: int, reason: str) -> str | None:
        """Hand a job back for a machine fault (`reason`): queued again without spending an attempt, at the end
        of the line, and after FREE_HANDBACKS with a backoff too; beyond HANDBACKS the attempt is spent (failed,
        or dead once out of attempts) and the count starts again. Returns the new state; None if not owned."""
        with self.db.tx() as conn:
            now = self.now(conn)
            job = conn.execute(select(jobs).where(*self._owned(job_id, worker_pid)).with_for_update()).first()
            if job is None:
                return None
            count = job.handbacks + 1
            values: dict[str, Any] = dict(last_error=reason, error_kind="machine", updated_at=now, lease_until=None,
                                          worker_pid=None, progress=0.0, detail=None)
            if count > HANDBACKS:
                state = FAILED if job.attempts < job.max_attempts else DEAD
                values |= dict(state=state, handbacks=0, finished_at=now if state == DEAD else None,
                               run_after=now + self.backoff.delay(job.attempts) if state == FAILED else job.run_after)
            else:
                state = QUEUED
                wait = self.backoff.delay(count - FREE_HANDBACKS) if count > FREE_HANDBACKS else 0.0
                values |= dict(state=state, handbacks=count, attempts=job.attempts - 1, run_after=now + wait)
            conn.execute(update(jobs).where(jobs.c.id == job_id).values(**values))
            if state != DEAD:
                self.db.dialect.notify(conn)
            return state

    @reconnecting
    def reap(self, alive: Callable[[int], bool] | None = None) -> list[int]:
        """Requeue the jobs of lost workers; dead once out of attempts.

        A worker is lost when its lease expired, or, for a worker on this host only, when its process is gone:
        `alive(pid)` says, by default whether that pid is still the process that claimed the job. Rows another
        transaction holds are left for the next reap. Cheap enough to run periodically: it only reads unless
        there is a job to requeue. IdentityInUse while another live daemon has this one's identity: its jobs
        would look like this machine's.
        """
        self.db.hold_identity()
        with self.db.read() as conn:
            now = self.now(conn)
            running = conn.execute(select(jobs).where(jobs.c.state == RUNNING)).all()
            if not any(self._lost(j, now, alive) for j in running):
                return []
        with self.db.tx() as conn:
            now = self.now(conn)
            running = conn.execute(
                select(jobs).where(jobs.c.state == RUNNING).with_for_update(skip_locked=True)
            ).all()
            lost = [j for j in running if self._lost(j, now, alive)]
            for j in lost:
                out_of_attempts = j.attempts >= j.max_attempts
                conn.execute(
                    update(jobs).where(jobs.c.id == j.id)
                    .values(state=DEAD if out_of_attempts else QUEUED, worker_pid=None, lease_until=None,
                            updated_at=now, finished_at=now if out_of_attempts else None,
                            error_kind="lost", last_error=f"worker {j.worker_pid} on {j.worker_host or self.host} "
                                                          f"stopped during attempt {j.attempts} "
                                                          "(lease expired or process gone)")
                )
            if lost:
                self.db.dialect.notify(conn)
        return [j.id for j in lost]

    def _lost(self, job: Any, now: float, alive: Callable[[int], bool] | None) -> bool:
        if job.lease_until is not None and job.lease_until < now:
            return True
        if job.worker_host not in (None, self.host):
            return False  # another machine's process cannot be asked after: its lease decides
        if job.worker_pid is None:
            return True
        return not (alive(job.worker_pid) if alive else same_process(job.worker_pid, job.worker_started))

    def _owned(self, job_id: int, worker_pid: int) -> tuple[Any, ...]:
        return (jobs.c.id == job_id, jobs.c.state == RUNNING, jobs.c.worker_pid == worker_pid,
                jobs.c.worker_host == self.host)

    # -- the person's side ------------------------------------------------------------------------

    @reconnecting
    def retry(self, job_id: int, *, path: str | Path | None = None) -> Job:
        """Queue a failed, dead or cancelled job again now, with its attempts reset; `path`: where its content is
        now (the caller checked), when its file moved."""
        moved = {} if path is None else {"path": str(path)}
        return self._set_state(job_id, QUEUED, (FAILED, DEAD, CANCELLED),
                               lambda now: dict(attempts=0, handbacks=0, run_after=now, finished_at=None, **moved))

    @reconnecting
    def cancel(self, job_id: int) -> Job:
        """Cancel a waiting or running job; a running worker notices at its next heartbeat."""
        return self._set_state(job_id, CANCELLED, (QUEUED, FAILED, RUNNING),
                               lambda now: dict(finished_at=now, lease_until=None))

    def _set_state(self, job_id: int, state: str, allowed: tuple[str, ...],
                   values: Callable[[float], dict[str, Any]]) -> Job:
        """Move the job from one of the `allowed` states to `state`, with `values(now)` besides."""
        with self.db.tx() as conn:
            now = self.now(conn)
            job = conn.execute(select(jobs).where(jobs.c.id == job_id).with_for_update()).first()
            if job is None:
                raise KeyError(f"no job {job_id}")
            if job.state not in allowed:
                allowed_text = ', '.join(allowed)
                raise ValueError(f"job {job_id} is {job.state}; only {allowed_text} jobs can be {state}")
            row = conn.execute(update(jobs).where(jobs.c.id == job_id).returning(*jobs.c)
                               .values(state=state, updated_at=now, **values(now))).one()
            if state in CLAIMABLE:
                self.db.dialect.notify(conn)
        return Job.from_row(row)

    # -- reading ----------------------------------------------------------------------------------

    @reconnecting
    def get(self, job_id: int) -> Job | None:
        with self.db.read() as conn:
            row = conn.execute(select(jobs).where(jobs.c.id == job_id)).first()
        return Job.from_row(row) if row else None

    @reconnecting
    def list(self, state: str | None = None, limit: int | None = None, *,
             newest_first: bool = False) -> list[Job]:
        if state is not None and state not in STATES:
            raise ValueError(f"unknown state {state!r} (states: {', '.join(STATES)})")
        query = select(jobs)
        if state is not None:
            query = query.where(jobs.c.state == state)
        order = jobs.c.updated_at.desc() if newest_first else jobs.c.id
        with self.db.read() as conn:
            return [Job.from_row(r) for r in conn.execute(query.order_by(order).limit(limit))]

    @reconnecting
    def counts(self) -> dict[str, int]:
        with self.db.read() as conn:
            found = dict(conn.execute(select(jobs.c.state, func.count()).group_by(jobs.c.state)).all())
        return {state: found.get(state, 0) for state in STATES}

    @reconnecting
    def has_runnable(self, open_windows: Sequence[str] = ()) -> bool:
        """Whether `claim` would find a job now; a read, so an idle daemon can ask without writing."""
        with self.db.read() as conn:
            return conn.execute(_runnable(self.now(conn), open_windows, self.host).limit(1)).first() is not None

    @reconnecting
    def open_windows_needed(self) -> list[str]:
        """The batch windows that waiting jobs are held for."""
        with self.db.read() as conn:
            return list(conn.execute(
                select(jobs.c.batch_window).distinct()
                .where(jobs.c.state.in_(CLAIMABLE), jobs.c.batch_window.is_not(None))
            ).scalars())
