"""The daemon's loop: take documents from the inboxes, run the queue's jobs one at a time, report.

    start: lock the home ─► clean leftovers ─► requeue jobs a killed run left ─► watch the inboxes
    loop:  the job gate says wait (or the machine failed: disk full, …)? ─► record why, sleep
           claim a job ─► pipeline (the gate's check, also before every model layer: pause, stop, cancel) ─► next
           nothing to do ─► idle; unload the model after `idle_unload_seconds`; `--once`: finish
           every `lease_seconds`: requeue the jobs of workers that died
    the pieces it runs:
           intake    the watcher's files queued, or set aside with the reason (daemon/intake.py)
           gate      batch reports, the power assertion, pauses and stops of the running job (daemon/gate.py)
           heartbeat the status row, the running job's lease, the stall watchdog (daemon/heartbeat.py)
    stop (SIGTERM/SIGINT): the running job is handed back to the queue before the next model layer runs

One daemon per home, enforced by a lock file the kernel releases when the process dies, so whoever
holds the lock knows every job still marked running in the home's own queue was left by a dead worker.
On a queue several homes and machines share, the worker is known by host, pid and start time, and only
jobs whose worker is gone (on this host) or whose lease expired (anywhere) are taken back.

Idle, the daemon reads the queue every `poll_seconds` and writes nothing: the status row is written when
what it says changes, and the heartbeat is renewed only while a job runs.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock, Timeout

from npumoe.jobs.errors import ModelUnavailable
from npumoe.jobs.extract.isolated import ExtractLimits
from npumoe.jobs.faults import MachineFault, machine_fault
from npumoe.jobs.files import KEEP
from npumoe.jobs.outputs import remove_leftovers
from npumoe.jobs.pipeline import Pipeline, Policy
from npumoe.jobs.queue.schema import DEAD, DONE, FAILED, QUEUED
from npumoe.jobs.queue.store import Job, Queue

from .config import Config
from .energy.awake import PowerAssertion
from .energy.measure import Meter
from .energy.priority import apply_background_priority, worker_threads
from .gate import JobGate
from .heartbeat import Heartbeat, StallWatch, StatusRow
from .home import Home, document_folders
from .intake import InboxIntake
from .model_choice import ModelSlot, backend_description
from .scheduler import Scheduler
from .watcher import InboxWatcher

log = logging.getLogger(__name__)

MODEL_RETRY_SECONDS = 60.0  # after a model failed to load, wait this long before trying again


class AlreadyRunning(RuntimeError):
    """Another npumoed holds this home."""


@contextmanager
def single_instance(home: Home, queue: Queue) -> Iterator[None]:
    lock = FileLock(home.lock, mode=0o600)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        row = queue.daemons.read() or {}
        pid = f" (pid {row['pid']})" if row.get("pid") and not row.get("stopped_at") else ""
        raise AlreadyRunning(f"another npumoed{pid} is already running for {home.root}") from None
    try:
        yield
    finally:
        lock.release()


@contextmanager
def stopped_by_signals(stop: Callable[[], None]) -> Iterator[None]:
    """SIGTERM and SIGINT call `stop` while inside. Only the main thread may set handlers: on another, whoever runs
    the worker there calls stop()."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum: int, _frame: object) -> None:
        log.info("%s: stopping; the running job goes back to the queue", signal.Signals(signum).name)
        stop()

    old = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in old.items():
            signal.signal(signum, handler)


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
        awake: PowerAssertion | None = None,
    ) -> None:
        self.config = config
        self.home = home
        self.queue = queue
        self.once = once
        self.pid = os.getpid()
        self.folders = document_folders(config, home, inboxes)
        self.model = model or ModelSlot(config, home, threads=worker_threads(config.cpu))
        self.scheduler = scheduler or Scheduler(config.scheduler, queue)
        self.awake = awake or PowerAssertion()
        self.summary = RunSummary()
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._next_reap = 0.0
        self.row = StatusRow(queue, power=lambda: {**self.scheduler.power_state(), "awake": self.awake.holding},
                             counters=self._counters)
        self.heartbeat = Heartbeat(queue, self.row, StallWatch(config.queue.stall_seconds), pid=self.pid,
                                   lease_seconds=config.queue.lease_seconds, stopping=self._stopping)
        self.gate = JobGate(self.scheduler, queue, home, self.awake, row=self.row, heartbeat=self.heartbeat,
                            stopping=self._stopping, poll_seconds=config.scheduler.poll_seconds,
                            obey_schedule=obey_schedule)
        e = config.extract
        policy = Policy(
            config.inbox.originals,
            ExtractLimits(timeout_s=e.timeout_seconds, memory_mb=e.memory_mb, max_bytes=int(e.max_mb * 2**20)),
            config.queue.lease_seconds,
        )
        self.pipeline = Pipeline(
            queue, self.folders, policy, self.model, worker_pid=self.pid,
            meter=Meter, checkpoint=self.gate.check, progressed=self._progressed,
            local_index=home.database if queue.shared else None,
        )
        self.intake = InboxIntake(queue, config, self.folders, settle=self.pipeline.settle, queued=self._wake.set)
        # Only kept originals need remembering: moved or deleted ones leave the inbox, and one left there by a
        # run that stopped between "done" and moving it must be seen again, to be moved.
        memory = queue.handed if config.inbox.originals == KEEP else None
        self.watcher = InboxWatcher(list(self.folders.inboxes), config.inbox, self.intake.take, memory=memory)

    def run(self) -> RunSummary:
        """Work until stopped (or, with `once`, until nothing runnable is left); raises AlreadyRunning."""
        with single_instance(self.home, self.queue), stopped_by_signals(self.stop):
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
        # What a killed run left: in an outbox other homes may share, only what this home's mark names.
        remove_leftovers(self.folders.outbox, self.folders.mark)
        remove_leftovers(self.folders.work)
        # The home's lock is held: no other worker of this home runs, so every running job was
        # left by a dead one. A shared queue's running jobs are other workers' unless their worker is gone.
        for job_id in self.queue.reap(alive=None if self.queue.shared else lambda pid: False):
            log.info("job %d was running when npumoed last stopped; queued again", job_id)
        if applied := apply_background_priority(self.config.cpu):
            log.info("running at background priority: %s", ", ".join(applied))
        self.row.open(pid=self.pid, model=self.config.model.name,
                      backend=backend_description(self.config.model.backend))
        log.info("npumoed %d started; watching %s", self.pid, ", ".join(map(str, self.folders.inboxes)))
        self.heartbeat.start()
        self.queue.listen(self._wake.set, self._stopping)  # a shared queue's NOTIFY ends an idle wait at once
        if self.once:
            self.watcher.drain(self._stopping)
        else:
            self.watcher.start()

    def _finish(self) -> None:
        self.watcher.stop()
        self._stopping.set()
        self.heartbeat.join()
        self.model.unload()
        self.awake.release()
        try:
            self.pipeline.record_unsettled()
        except MachineFault as fault:  # left running: the next start takes those jobs back
            log.warning("stopping before the ends of some jobs could be recorded: %s", fault)
        self.summary.waiting = sum(self.queue.counts()[s] for s in (QUEUED, FAILED))
        self.summary.rejected = self.intake.rejected
        self.row.close()
        log.info("npumoed %d stopped", self.pid)

    # -- the loop ---------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                if not self._turn():
                    return
            except ModelUnavailable as e:
                log.error("cannot load the model: %s", e)
                if self.once:
                    raise
                self.row.set("waiting", f"the model could not be loaded: {e}")
                self._wait(MODEL_RETRY_SECONDS)
            except Exception as e:  # the database's own fault between jobs (claiming, reaping): wait it out
                if (fault := machine_fault(e, self.folders.outbox, database=self.queue.path)) is None:
                    raise
                log.warning("the queue could not be used: %s; waiting", fault)
                self.scheduler.hold(fault)
                self._wait(self.config.scheduler.poll_seconds)

    def _turn(self) -> bool:
        """One pass of the loop: wait, or run a job, or idle. False: `--once` found nothing left to do."""
        poll = self.config.scheduler.poll_seconds
        decision = self.gate.decide()
        if not decision.run and not decision.idle:
            self.row.set("waiting", decision.reason)
            self._wait(poll)
            return True
        self._reap_now_and_then()
        self.pipeline.record_unsettled()  # the ends of earlier jobs the database would not take then
        job = None if decision.idle else self.queue.claim(
            self.pid, lease_seconds=self.config.queue.lease_seconds, open_windows=decision.open_windows
        )
        if job is None:
            if self.once:
                return False
            self.row.set("idle", decision.reason or decision.held)
            self.model.unload_if_idle()
            self._wait(poll)
            return True
        try:
            self._work(job)
        except MachineFault as fault:
            log.warning("job %d handed back, its attempt not counted: %s", job.id, fault)
            self.scheduler.hold(fault)
        return True

    def _reap_now_and_then(self) -> None:
        """Requeue the jobs of workers that died (their lease ran out), once every `lease_seconds`."""
        if time.monotonic() < self._next_reap:
            return
        self._next_reap = time.monotonic() + self.config.queue.lease_seconds
        for job_id in self.queue.reap():
            log.info("job %d: its worker stopped renewing the lease; queued again", job_id)

    def _work(self, job: Job) -> None:
        log.info("job %d: %s", job.id, job.path)
        with self.heartbeat.watching(), self.gate.running(job):
            self.row.set("working", "", current_job=job.id)
            try:
                outcome = self.pipeline.process(job)
            finally:
                self.model.touch()
                self.row.set("working", "", current_job=None)
        self.summary.outcomes[outcome.state] += 1
        if outcome.state in (DONE, DEAD):  # copies of its document that waited for its end: settled or followed
            self.intake.recheck(job.id)
        where = f" → {outcome.output_dir}" if outcome.output_dir else f": {outcome.reason}"
        log.info("job %d %s%s", job.id, outcome.state, where)

    def _wait(self, seconds: float) -> None:
        self._wake.wait(seconds)
        self._wake.clear()

    def _progressed(self, phase: str) -> None:
        """The running job moved on (between two chunks, or two steps of the pipeline): the stall watch hears it."""
        self.heartbeat.stall.moved(phase)

    def _counters(self) -> dict[str, int]:
        """What the status row counts."""
        return {
            **self.summary.outcomes,
            "rejected": self.intake.rejected,
            "model_loads": self.model.loads,
            "model_loaded": int(self.model.loaded),
            "inbox_waiting": self.watcher.tracker.waiting,
        }
