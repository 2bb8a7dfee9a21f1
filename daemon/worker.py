"""The daemon's loop: take documents from the inboxes, run the queue's jobs one at a time, report.

    start: lock the home ─► clean leftovers ─► requeue jobs a killed run left ─► watch the inboxes
    loop:  scheduler says wait? ─► record why, sleep
           claim a job ─► pipeline (checkpoint between chunks: pause, stop, cancel) ─► next
           nothing to do ─► idle; unload the model after `idle_unload_seconds`; `--once`: finish
    stop (SIGTERM/SIGINT): the running job is handed back to the queue at its next checkpoint

One daemon per home, enforced by a lock file the kernel releases when the process dies, so whoever
holds the lock knows every job still marked running was left by a dead worker.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from npumoe.daemon.batch import write_batch_report
from npumoe.daemon.config import Config
from npumoe.daemon.home import Home
from npumoe.daemon.intake import enqueue
from npumoe.daemon.measure import Meter
from npumoe.daemon.models import ModelSlot, backend_description
from npumoe.daemon.priority import apply_background_priority, worker_threads
from npumoe.daemon.scheduler import Decision, Scheduler
from npumoe.daemon.watcher import InboxWatcher
from npumoe.jobs.errors import FileRefused, Lost, ModelUnavailable, Stop
from npumoe.jobs.extract import ExtractLimits
from npumoe.jobs.files import Folders, set_aside, settle_original
from npumoe.jobs.outputs import remove_leftovers
from npumoe.jobs.pipeline import Pipeline, Policy
from npumoe.jobs.queue import Job, Queue

log = logging.getLogger(__name__)

BEAT_SECONDS = 2.0  # how often the heartbeat row (and the running job's lease) is renewed
MODEL_RETRY_SECONDS = 60.0  # after a model failed to load, wait this long before trying again


class AlreadyRunning(RuntimeError):
    """Another npumoed holds this home."""


@contextmanager
def single_instance(home: Home, queue: Queue) -> Iterator[None]:
    lock = FileLock(home.root / "npumoed.lock", mode=0o600)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        row = queue.read_daemon() or {}
        pid = f" (pid {row['pid']})" if row.get("pid") and not row.get("stopped_at") else ""
        raise AlreadyRunning(f"another npumoed{pid} is already running for {home.root}") from None
    try:
        yield
    finally:
        lock.release()


@dataclass
class RunSummary:
    outcomes: Counter[str] = field(default_factory=Counter)  # done, failed, dead, queued (handed back), lost
    rejected: int = 0  # files in an inbox that could not even be queued (links, FIFOs, unreadable)
    waiting: int = 0  # jobs left for later when `--once` finished: retry backoff, batch windows


class Worker:
    def __init__(
        self,
        config: Config,
        home: Home,
        queue: Queue,
        *,
        inboxes: Sequence[Path] | None = None,
        once: bool = False,
        obey_schedule: bool = True,
        model: ModelSlot | None = None,
        scheduler: Scheduler | None = None,
    ) -> None:
        self.config = config
        self.home = home
        self.queue = queue
        self.once = once
        self.obey_schedule = obey_schedule
        self.pid = os.getpid()
        self.inboxes = [Path(p).resolve() for p in inboxes] if inboxes else home.inboxes(config)
        self.folders = Folders(home.outbox, home.processed, home.failed, tuple(self.inboxes))
        self.model = model or ModelSlot(config, home, threads=worker_threads(config.cpu))
        self.scheduler = scheduler or Scheduler(config.scheduler, queue)
        self.watcher = InboxWatcher(self.inboxes, config.inbox, self._take)
        e = config.extract
        policy = Policy(
            config.inbox.originals,
            ExtractLimits(timeout_s=e.timeout_seconds, memory_mb=e.memory_mb, max_bytes=int(e.max_mb * 2**20)),
            config.queue.lease_seconds,
        )
        self.pipeline = Pipeline(
            queue, self.folders, policy, self.model, worker_pid=self.pid, meter=Meter, checkpoint=self._checkpoint
        )
        self.summary = RunSummary()
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._state: dict[str, Any] = {"activity": "starting", "reason": "", "current_job": None}
        self._lost_job: int | None = None
        self._current: Job | None = None
        self._beat: threading.Thread | None = None
        self._old_handlers: dict[int, Any] = {}

    def run(self) -> RunSummary:
        """Work until stopped (or, with `once`, until nothing runnable is left); raises AlreadyRunning."""
        with single_instance(self.home, self.queue):
            old_umask = os.umask(0o077)
            try:
                self._start()
                self._loop()
            finally:
                self._finish()
                os.umask(old_umask)
        return self.summary

    def stop(self) -> None:
        """Finish the current step, hand the running job back, and return from `run`."""
        self._stopping.set()
        self._wake.set()

    # -- start and finish -------------------------------------------------------------------------------

    def _start(self) -> None:
        for folder in (self.home.root, self.home.outbox, self.home.processed, self.home.failed, self.home.models,
                       self.home.reports):
            for leftover in remove_leftovers(folder):
                log.info("removed %s, left by a run that was killed", leftover)
        # Whoever holds the lock is the only worker there is: every running job was left by a dead one.
        for job_id in self.queue.reap(alive=lambda pid: False):
            log.info("job %d was running when npumoed last stopped; queued again", job_id)
        if applied := apply_background_priority(self.config.cpu):
            log.info("running at background priority: %s", ", ".join(applied))
        now = time.time()
        self.queue.write_daemon(
            pid=self.pid,
            started_at=now,
            heartbeat_at=now,
            stopped_at=None,
            model=self.config.model.name,
            backend=backend_description(self.config.model.backend),
            power=self.scheduler.power_state(),
            **self._state,
            counters=self._counters(),
        )
        self._handle_signals()
        log.info("npumoed %d started; watching %s", self.pid, ", ".join(map(str, self.inboxes)))
        self._beat = threading.Thread(target=self._beat_loop, name="heartbeat", daemon=True)
        self._beat.start()
        if self.once:
            self.watcher.drain(self._stopping)
        else:
            self.watcher.start()

    def _finish(self) -> None:
        self.watcher.stop()
        self._stopping.set()
        if self._beat is not None:
            self._beat.join(timeout=BEAT_SECONDS * 2)
        self.model.unload()
        self.summary.waiting = sum(self.queue.counts()[s] for s in ("queued", "failed"))
        self._set("stopped", "", current_job=None)
        self.queue.write_daemon(stopped_at=time.time())
        self._restore_signals()
        log.info("npumoed %d stopped", self.pid)

    def _handle_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers; whoever runs us there calls stop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._old_handlers[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        log.info("%s: stopping; the running job goes back to the queue", signal.Signals(signum).name)
        self.stop()

    def _restore_signals(self) -> None:
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, handler)

    # -- the loop ---------------------------------------------------------------------------------------

    def _loop(self) -> None:
        poll = self.config.scheduler.poll_seconds
        while not self._stopping.is_set():
            decision = self._decide()
            if not decision.run:
                self._set("waiting", decision.reason)
                self._wait(poll)
                continue
            job = self.queue.claim(
                self.pid, lease_seconds=self.config.queue.lease_seconds, open_windows=decision.open_windows
            )
            if job is None:
                if self.once:
                    return
                self._set("idle", decision.held)
                self.model.unload_if_idle()
                self._wait(poll)
                continue
            try:
                self._work(job)
            except ModelUnavailable as e:
                log.error("cannot load the model: %s", e)
                if self.once:
                    raise
                self._set("waiting", f"the model could not be loaded: {e}")
                self._wait(MODEL_RETRY_SECONDS)

    def _work(self, job: Job) -> None:
        log.info("job %d: %s", job.id, job.path)
        self._lost_job = None
        self._current = job
        self._set("working", "", current_job=job.id)
        try:
            outcome = self.pipeline.process(job)
        finally:
            self._current = None
            self.model.touch()
            self._set("working", "", current_job=None)
        self.summary.outcomes[outcome.state] += 1
        where = f" → {outcome.output_dir}" if outcome.output_dir else f": {outcome.reason}"
        log.info("job %d %s%s", job.id, outcome.state, where)

    def _decide(self) -> Decision:
        if not self.obey_schedule:
            return Decision(run=True, reason="", open_windows=tuple(self.queue.open_windows_needed()))
        decision = self.scheduler.decide()
        for closed in self.scheduler.closed_windows():
            report = write_batch_report(self.queue, self.home, closed.window, closed.started, closed.ended)
            log.info("batch window %s closed; report in %s", closed.window, report)
        return decision

    def _checkpoint(self) -> None:
        """Between steps and chunks: stop, notice a cancel, or wait while the scheduler says so."""
        waited = False
        while True:
            if self._stopping.is_set():
                raise Stop
            if self._lost_job is not None and self._lost_job == self._state["current_job"]:
                raise Lost
            decision = self._decide()
            window = self._current.batch_window if self._current else None
            if window is not None and window not in decision.open_windows:
                raise Stop(f"its batch window {window} closed")
            if decision.run:
                if waited:
                    self._set("working", "")
                return
            if not waited:
                log.info("pausing job %s: %s", self._state["current_job"], decision.reason)
            waited = True
            self._set("waiting", decision.reason)
            self._stopping.wait(self.config.scheduler.poll_seconds)

    def _wait(self, seconds: float) -> None:
        self._wake.wait(seconds)
        self._wake.clear()

    # -- the inboxes (called on the watcher's thread) ----------------------------------------------------

    def _take(self, path: Path) -> None:
        """Queue a document the watcher found complete, or set it aside with the reason it cannot be."""
        try:
            job, created = enqueue(self.queue, path, self.config)
        except (OSError, ValueError) as e:  # FileRefused, a ValueError, says why the file is no document
            if isinstance(e, FileRefused) and e.kind == "missing":
                log.info("%s disappeared before it could be queued", path)
                return
            log.warning("not queued: %s: %s", path, e)
            set_aside(path, f"not queued: {e}\n", self.folders)
            self.summary.rejected += 1
            return
        if created:
            log.info("queued job %d: %s", job.id, path)
            self._wake.set()
        elif job.state == "done":  # finished earlier, e.g. stopped between "done" and moving the original
            settle_original(path, self.config.inbox.originals, self.folders)

    # -- what `npumoed status` reads ---------------------------------------------------------------------

    def _set(self, activity: str, reason: str, **values: Any) -> None:
        self._state.update(activity=activity, reason=reason, **values)
        self._write_row()

    def _write_row(self) -> None:
        self.queue.write_daemon(heartbeat_at=time.time(), **self._state, counters=self._counters())

    def _beat_loop(self) -> None:
        while not self._stopping.wait(BEAT_SECONDS):
            try:
                job_id = self._state["current_job"]
                if job_id is not None and not self.queue.heartbeat(
                    job_id, self.pid, lease_seconds=self.config.queue.lease_seconds
                ):
                    self._lost_job = job_id
                self.queue.write_daemon(
                    heartbeat_at=time.time(), power=self.scheduler.power_state(), counters=self._counters()
                )
            except Exception:  # a busy database must not end the heartbeat for good
                log.exception("heartbeat failed")

    def _counters(self) -> dict[str, int]:
        return {
            **self.summary.outcomes,
            "rejected": self.summary.rejected,
            "model_loads": self.model.loads,
            "model_loaded": int(self.model.loaded),
            "inbox_waiting": self.watcher.tracker.waiting,
        }
