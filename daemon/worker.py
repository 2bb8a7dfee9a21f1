"""The daemon's loop: take documents from the inboxes, run the queue's jobs one at a time, report.

    start: lock the home ─► clean leftovers ─► requeue jobs a killed run left ─► watch the inboxes
    loop:  scheduler says wait (or the machine failed: disk full, …)? ─► record why, sleep
           claim a job ─► pipeline (the check, also before every model layer: pause, stop, cancel) ─► next
           nothing to do ─► idle; unload the model after `idle_unload_seconds`; `--once`: finish
           every `lease_seconds`: requeue the jobs of workers that died
           an open batch window with work in it ─► hold a power assertion (daemon/awake.py) until done
           a batch window closed ─► write its report (daemon/batch.py)
    searches: a query on the home's socket is embedded by this process's model, on this thread, between two
           chunks of the running job or at once when idle (daemon/queries.py)
    stop (SIGTERM/SIGINT): the running job is handed back to the queue before the next model layer runs
    stall: a job without progress for `stall_seconds` is stopped and retried; a process stuck in a call that
           never returns records that and exits (EXIT_STUCK) for the service manager to restart it

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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from npumoe.jobs.errors import Failure, FileRefused, Lost, ModelUnavailable, Stop
from npumoe.jobs.extract.isolated import ExtractLimits
from npumoe.jobs.faults import MachineFault, machine_fault
from npumoe.jobs.files import KEEP, Folders, set_aside
from npumoe.jobs.outputs import remove_leftovers
from npumoe.jobs.pipeline import Pipeline, Policy
from npumoe.jobs.queue.schema import DONE, FAILED, QUEUED
from npumoe.jobs.queue.store import Job, Queue
from npumoe.jobs.search.index import vectors_key

from .batch import write_batch_report
from .config import Config
from .energy.awake import PowerAssertion, windows_to_stay_awake_for
from .energy.measure import Meter
from .energy.priority import apply_background_priority, worker_threads
from .home import Home
from .intake import enqueue
from .model_choice import ModelSlot, backend_description
from .queries import QueryServer
from .scheduler import Decision, Scheduler
from .stall import StallWatch
from .watcher import InboxWatcher

log = logging.getLogger(__name__)

BEAT_SECONDS = 2.0  # how often the heartbeat row (and the running job's lease) is renewed
MODEL_RETRY_SECONDS = 60.0  # after a model failed to load, wait this long before trying again
# The check runs before every model layer: the scheduler is asked at most this often meanwhile, so that a pause or
# a closed batch window is seen within this long of a layer, without a query of the queue for every one.
RULING_SECONDS = 0.25
EXIT_STUCK = 75  # EX_TEMPFAIL: the process gave up on a call that never returned; the service restarts it


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
        self.obey_schedule = obey_schedule
        self.pid = os.getpid()
        self.inboxes = [Path(p).resolve() for p in inboxes] if inboxes else home.inboxes(config)
        self.outbox = home.outputs(config)
        self.folders = Folders(self.outbox, home.processed, home.failed, tuple(self.inboxes))
        self.model = model or ModelSlot(config, home, threads=worker_threads(config.cpu))
        self.scheduler = scheduler or Scheduler(config.scheduler, queue)
        # Only kept originals need remembering: moved or deleted ones leave the inbox, and one left there by a
        # run that stopped between "done" and moving it must be seen again, to be moved.
        memory = queue.handed if config.inbox.originals == KEEP else None
        self.awake = awake or PowerAssertion()
        self.watcher = InboxWatcher(self.inboxes, config.inbox, self._take, memory=memory)
        self.stall = StallWatch(config.queue.stall_seconds)
        e = config.extract
        policy = Policy(
            config.inbox.originals,
            ExtractLimits(timeout_s=e.timeout_seconds, memory_mb=e.memory_mb, max_bytes=int(e.max_mb * 2**20)),
            config.queue.lease_seconds,
        )
        self.pipeline = Pipeline(
            queue, self.folders, policy, self.model, worker_pid=self.pid,
            meter=Meter, checkpoint=self._check, progressed=self._progressed,
            local_index=home.database if queue.shared else None,
        )
        self.summary = RunSummary()
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self.queries = QueryServer(home.socket, wake=self._wake.set)
        self._state: dict[str, Any] = {"activity": "starting", "reason": "", "current_job": None}
        self._lost_job: int | None = None
        self._stalled_job: int | None = None
        self._next_reap = 0.0
        self._ruling: Decision | None = None  # the scheduler's last word while a job runs, and when to ask again
        self._ruling_due = 0.0
        self._current: Job | None = None
        self._beat: threading.Thread | None = None
        self._written: dict[str, Any] = {}  # the status row as last written, to write only what changed
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
        self.outbox.mkdir(parents=True, exist_ok=True)  # a shared one is not swept: others are writing there
        # Whoever holds the lock of a home's own queue is the only worker there is: every running job was
        # left by a dead one. A shared queue's running jobs are other workers' unless their worker is gone.
        for job_id in self.queue.reap(alive=None if self.queue.shared else lambda pid: False):
            log.info("job %d was running when npumoed last stopped; queued again", job_id)
        if applied := apply_background_priority(self.config.cpu):
            log.info("running at background priority: %s", ", ".join(applied))
        now = time.time()
        self.queue.daemons.write(
            pid=self.pid,
            started_at=now,
            stopped_at=None,
            model=self.config.model.name,
            backend=backend_description(self.config.model.backend),
        )
        self._write_row()
        self._handle_signals()
        log.info("npumoed %d started; watching %s", self.pid, ", ".join(map(str, self.inboxes)))
        try:
            self.queries.start()
        except OSError as e:
            log.warning("not answering searches (each `npumoed search` loads the model itself): %s", e)
        self._beat = threading.Thread(target=self._beat_loop, name="heartbeat", daemon=True)
        self._beat.start()
        self.queue.listen(self._wake.set, self._stopping)  # a shared queue's NOTIFY ends an idle wait at once
        if self.once:
            self.watcher.drain(self._stopping)
        else:
            self.watcher.start()

    def _finish(self) -> None:
        self.queries.stop()
        self.watcher.stop()
        self._stopping.set()
        if self._beat is not None:
            self._beat.join(timeout=BEAT_SECONDS * 2)
        self.model.unload()
        self.awake.release()
        try:
            self.pipeline.record_unsettled()
        except MachineFault as fault:  # left running: the next start takes those jobs back
            log.warning("stopping before the ends of some jobs could be recorded: %s", fault)
        self.summary.waiting = sum(self.queue.counts()[s] for s in (QUEUED, FAILED))
        self._set("stopped", "", current_job=None)
        self.queue.daemons.write(stopped_at=time.time())
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
        while not self._stopping.is_set():
            try:
                if not self._turn():
                    return
            except ModelUnavailable as e:
                log.error("cannot load the model: %s", e)
                if self.once:
                    raise
                self._set("waiting", f"the model could not be loaded: {e}")
                self._wait(MODEL_RETRY_SECONDS)
            except Exception as e:  # the database's own fault between jobs (claiming, reaping): wait it out
                if (fault := machine_fault(e, self.outbox, database=self.queue.path)) is None:
                    raise
                log.warning("the queue could not be used: %s; waiting", fault)
                self.scheduler.hold(fault)
                self._wait(self.config.scheduler.poll_seconds)

    def _turn(self) -> bool:
        """One pass of the loop: wait, or run a job, or idle. False: `--once` found nothing left to do."""
        poll = self.config.scheduler.poll_seconds
        self.queries.answer(self._embed_query)  # searches asked of the daemon, between jobs
        decision = self._decide()
        if not decision.run and not decision.idle:
            self._set("waiting", decision.reason)
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
            self._set("idle", decision.reason or decision.held)
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
        self._lost_job = self._stalled_job = None
        self._current = job
        self._ruling = None  # the last job's: the scheduler is asked afresh for this one
        self._set("working", "", current_job=job.id)
        self.stall.start()
        try:
            outcome = self.pipeline.process(job)
        finally:
            self.stall.finish()
            self._current = None
            self.model.touch()
            self._set("working", "", current_job=None)
        self.summary.outcomes[outcome.state] += 1
        where = f" → {outcome.output_dir}" if outcome.output_dir else f": {outcome.reason}"
        log.info("job %d %s%s", job.id, outcome.state, where)

    def _progressed(self, phase: str) -> None:
        """The running job moved on (between two chunks, or two steps of the pipeline; no forward pass is
        running): the stall watch hears it, and waiting searches are answered."""
        self.stall.moved(phase)
        self.queries.answer(self._embed_query)

    def _embed_query(self, text: str) -> tuple[str, Any]:
        engine = self.model.load()  # idle and unloaded, the daemon loads it once for this and later queries
        return vectors_key(engine.model_key, engine.settings.pooling), engine.embed(text)

    def _decide(self) -> Decision:
        """The scheduler's decision, acted on: the reports of batch windows that closed, the power assertion."""
        decision = self._rule()
        if not self.obey_schedule:
            return decision
        for closed in self.scheduler.closed_windows():
            report = write_batch_report(self.queue, self.home, closed.window, closed.started, closed.ended)
            log.info("batch window %s closed; report in %s", closed.window, report)
        self._stay_awake(decision)
        return decision

    def _stay_awake(self, decision: Decision) -> None:
        if windows := windows_to_stay_awake_for(decision, self._current.batch_window if self._current else None):
            self.awake.hold(f"batch window {', '.join(windows)}")
        else:
            self.awake.release()

    def _rule(self) -> Decision:
        """Whether work may run now, and why not, without acting on it."""
        if not self.obey_schedule:
            fault = self.scheduler.fault_reason()  # a full disk is full whatever the schedule says
            return Decision(run=not fault, reason=fault, open_windows=tuple(self.queue.open_windows_needed()))
        return (self._current is None and self.scheduler.idle()) or self.scheduler.decide()

    def _check(self) -> None:
        """The running job's check, between the pipeline's steps and before every model layer: hand the job back
        (raise) on a stop, a stall, a cancel or its batch window's end; wait (block) while the scheduler says so.
        It only stops or pauses: batch reports and the power assertion are the loop's, once the job is over."""
        waited = False
        while True:
            self._interrupt()
            if self._lost_job is not None and self._lost_job == self._state["current_job"]:
                raise Lost
            decision = self._ruling_now(fresh=waited)
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
            self.stall.moved(self.stall.phase)  # a pause is not a stall
            self._set("waiting", decision.reason)
            self._stopping.wait(self.config.scheduler.poll_seconds)

    def _ruling_now(self, *, fresh: bool) -> Decision:
        """The scheduler's decision for the running job, asked again when `fresh` or after RULING_SECONDS."""
        if fresh or self._ruling is None or time.monotonic() >= self._ruling_due:
            self._ruling = self._rule()
            self._ruling_due = time.monotonic() + RULING_SECONDS
        return self._ruling

    def _interrupt(self) -> None:
        """A stop hands the job back, a stall fails this attempt."""
        if self._stopping.is_set():
            raise Stop
        if self._stalled_job is not None and self._stalled_job == self._state["current_job"]:
            raise Failure("stalled", f"no progress for over {self.stall.stall_seconds:g} s while {self.stall.phase} "
                          "(queue.stall_seconds); stopped, to be tried again", retryable=True)

    def _wait(self, seconds: float) -> None:
        self._wake.wait(seconds)
        self._wake.clear()

    # -- the inboxes (called on the watcher's thread) ----------------------------------------------------

    def _take(self, path: Path) -> bool:
        """Queue a document the watcher found complete, or set it aside with the reason it cannot be.

        Returns whether the file is dealt with: False when the machine failed (an I/O error on a network
        share, …), so the watcher offers it again at its next rescan instead of forgetting it.
        """
        try:
            job, created = enqueue(self.queue, path, self.config, pinned=True)  # this machine's inbox: its file
        except (OSError, ValueError) as e:  # FileRefused, a ValueError, says why the file is no document
            if (fault := machine_fault(e, path.parent)) is not None:
                log.warning("not queued yet: %s: %s", path, fault)
                return False
            if isinstance(e, FileRefused) and e.kind == "missing":
                log.info("%s disappeared before it could be queued", path)
                return True
            if isinstance(e, FileRefused) and e.denied:  # a person may put that right: offered again at the rescan
                log.warning("not queued yet: %s: %s", path, e)
                return False
            log.warning("not queued: %s: %s", path, e)
            set_aside(path, f"not queued: {e}\n", self.folders)
            self.summary.rejected += 1
            return True
        if created:
            log.info("queued job %d: %s", job.id, path)
            self._wake.set()
        elif job.state == DONE:  # finished earlier, e.g. stopped between "done" and moving the original
            self.pipeline.settle(job, path)
        return True

    # -- what `npumoed status` reads ---------------------------------------------------------------------

    def _set(self, activity: str, reason: str, **values: Any) -> None:
        self._state.update(activity=activity, reason=reason, **values)
        self._write_row()

    def _write_row(self, *, beat: bool = False) -> None:
        """Write the status row when what it says changed; `beat`: also to renew its heartbeat (a job runs)."""
        row = {**self._state, "power": {**self.scheduler.power_state(), "awake": self.awake.holding},
               "counters": self._counters()}
        if beat or row != self._written:
            self.queue.daemons.write(heartbeat_at=time.time(), **row)
            self._written = row

    def _beat_loop(self) -> None:
        while not self._stopping.wait(BEAT_SECONDS):
            try:
                job_id = self._state["current_job"]
                if job_id is not None and (stalled := self.stall.stalled_for()) is not None:
                    self._on_stall(job_id, stalled)  # and the lease is no longer renewed
                elif job_id is not None and not self.queue.heartbeat(
                    job_id, self.pid, lease_seconds=self.config.queue.lease_seconds
                ):
                    self._lost_job = job_id
                self._write_row(beat=job_id is not None)
            except Exception:  # a busy database must not end the heartbeat for good
                log.exception("heartbeat failed")

    def _on_stall(self, job_id: int, stalled: float) -> None:
        """First ask the job to stop at its next check; if it has not reached one after as long again (at least
        a few beats, at most a minute), it is stuck in a call that never returns: record that and exit."""
        if self._stalled_job != job_id:
            log.warning("job %d: no progress for %.0f s while %s; stopping it", job_id, stalled, self.stall.phase)
            self._stalled_job = job_id
            return
        grace = min(max(self.stall.stall_seconds, 3 * BEAT_SECONDS), 60.0)
        if stalled < self.stall.stall_seconds + grace:
            return
        reason = (f"no progress for {stalled:.0f} s while {self.stall.phase}, and stuck in a call that did not "
                  "return; npumoed exited to be restarted")
        self.queue.fail(job_id, self.pid, reason, kind="stalled", retryable=True)
        log.critical("job %d: %s", job_id, reason)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(EXIT_STUCK)

    def _counters(self) -> dict[str, int]:
        return {
            **self.summary.outcomes,
            "rejected": self.summary.rejected,
            "model_loads": self.model.loads,
            "model_loaded": int(self.model.loaded),
            "inbox_waiting": self.watcher.tracker.waiting,
        }
