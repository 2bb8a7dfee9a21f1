"""One document, start to finish: copy → extract → prefill → summary + embeddings → outputs → done.

The worker claims a job and hands it to `Pipeline.process`, which always leaves the job in a settled
state: done, failed (will retry), dead (gave up, original set aside in `failed/` with a `.error.txt`),
or handed back to the queue untouched, without spending an attempt, when the worker is stopping, the
model cannot be loaded or the machine failed (disk full, I/O error, the database's own faults: see
faults.py; a few times, then the attempt counts: see `Queue.hand_back`). The last two escape as
ModelUnavailable and MachineFault, so the worker can wait. No document's failure escapes: one bad
document cannot stop the daemon, nor can a database that will not record how a job ended (it is
recorded later, `record_unsettled`).

Each step has its module: reading.py (the private copy, checked against the job's hash, and its text),
inference.py and progress.py (the engine's run, recorded with the job), results.py (the output folder),
originals.py (the person's file, once done), outcomes.py (every other end, recorded with the queue).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from .errors import Failure, Lost, ModelUnavailable, Stop
from .extract.isolated import ExtractLimits
from .faults import MachineFault
from .files import KEEP, ORIGINALS, Folders, Version
from .inference import run_engine
from .originals import Originals
from .outcomes import Outcome, Outcomes, lost
from .outputs import temporary_path
from .progress import JobProgress
from .queue.schema import DONE
from .queue.store import Job, Queue
from .reading import copy_document, extract
from .results import Measurement, Run, finished_output, write_outputs
from .search.index import IndexEntry, mark_stale, write_local

if TYPE_CHECKING:
    from npumoe.engine import Engine, EngineSettings

log = logging.getLogger(__name__)

LOADING = "loading the model"  # the phase reported while the model loads (it reports no progress meanwhile)


class Model(Protocol):
    """Where the pipeline gets its engine: `load` returns it loaded (or raises ModelUnavailable)."""

    @property
    def settings(self) -> EngineSettings: ...

    def load(self) -> Engine: ...


@dataclass(frozen=True)
class Policy:
    originals: str = KEEP  # one of ORIGINALS, once a document is done
    limits: ExtractLimits = field(default_factory=ExtractLimits)
    lease_seconds: float = 120.0

    def __post_init__(self) -> None:
        if self.originals not in ORIGINALS:
            raise ValueError(f"originals must be one of {', '.join(ORIGINALS)}, got {self.originals!r}")


class Pipeline:
    def __init__(
        self,
        queue: Queue,
        folders: Folders,
        policy: Policy,
        model: Model,
        *,
        worker_pid: int,
        meter: Callable[[], AbstractContextManager[Measurement]],
        checkpoint: Callable[[], None] = lambda: None,
        progressed: Callable[[str], None] = lambda phase: None,
        local_index: Path | None = None,
    ) -> None:
        """`checkpoint` runs between steps, and the engine runs it before every model layer (so within each
        prefill chunk and decode step): it may block (a pause) or raise Stop (or Lost, or a Failure for a job the
        worker gave up on); it decides nothing else. `progressed(phase)` is told each time the job moves on.
        `local_index`: the home's own database, where done documents are indexed when the queue is shared (on
        SQLite, the queue's own database)."""
        self.queue = queue
        self.folders = folders
        self.policy = policy
        self.model = model
        self.pid = worker_pid
        self.meter = meter
        self.checkpoint = checkpoint
        self.progressed = progressed
        self.local_index = local_index
        self.outcomes = Outcomes(queue, folders, worker_pid)
        self.originals = Originals(queue, folders, policy.originals, policy.limits.max_bytes)

    def process(self, job: Job) -> Outcome:
        try:
            return self._process(job)
        except Stop as stop:
            return self.outcomes.release(job, f"handed back: {stop}")
        except ModelUnavailable:
            self.outcomes.release(job, "handed back: the model could not be loaded")
            raise
        except MachineFault as fault:
            return self.outcomes.hand_back(job, fault)
        except Lost:
            return lost(job)
        except Failure as failure:
            return self.outcomes.fail(job, failure)
        except Exception as e:  # a bug of ours must not stop the daemon: record it and go on
            if (fault := self.outcomes.machine_fault(e)) is not None:
                return self.outcomes.hand_back(job, fault)
            log.exception("job %d: unexpected error", job.id)
            failure = Failure("internal", f"internal error: {type(e).__name__}: {e}", retryable=True)
            return self.outcomes.fail(job, failure)

    def record_unsettled(self) -> None:
        """Record the ends of jobs the database would not take when they ended (see `Outcomes.record_unsettled`)."""
        self.outcomes.record_unsettled()

    def settle(self, job: Job, source: Path, identity: Version | None = None) -> None:
        """Keep, move or delete the original of the done `job` by policy, if `source` still holds its content."""
        self.originals.settle(job, source, identity)

    def _process(self, job: Job) -> Outcome:
        source = Path(job.path)
        finished = finished_output(self.folders.outbox, job)
        if finished is not None:  # an earlier attempt wrote everything, then stopped before marking it done
            log.info("job %d: outputs already complete in %s", job.id, finished)
            return self._complete(job, finished, identity=None)

        progress = JobProgress(self.queue, job, self.pid, self.policy.lease_seconds, self.progressed)
        progress.report("reading")
        with self._work_folder(job) as work:
            copy, sha256, identity = copy_document(source, work, self.policy.limits.max_bytes)
            if sha256 != job.sha256:
                self.originals.requeue_changed(job, sha256)
            self.checkpoint()

            with self.meter() as meter:
                progress.report("extracting")
                started = time.perf_counter()
                extracted = extract(copy, self.policy.limits, self.checkpoint)
                extract_s = time.perf_counter() - started
                self.checkpoint()
                progress.report(LOADING)
                engine = self.model.load()
                result = run_engine(engine, extracted.text, progress, self.checkpoint)

        run = Run(self.model.settings, engine, extracted, extract_s, result, meter)
        return self._complete(job, write_outputs(self.folders.outbox, job, run, mark=self.folders.mark), identity)

    @contextmanager
    def _work_folder(self, job: Job) -> Iterator[Path]:
        """A private folder for the job's copy of its document (in the home: see `Folders.work`), removed with all it
        holds when the block ends."""
        work = temporary_path(self.folders.work, f"job{job.id}")
        work.mkdir(mode=0o700)
        try:
            yield work
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _complete(self, job: Job, out: Path, identity: Version | None) -> Outcome:
        """Mark the job done, index its outputs, then settle the original: only the very file that was read
        (`identity`; None when this attempt did not read it), and a file saved again meanwhile is queued as a new
        document instead."""
        if not self.queue.complete(job.id, self.pid, output_dir=str(out)):
            raise Lost
        self._index(job, out)
        self.originals.settle(job, Path(job.path), identity)
        return Outcome(job.id, DONE, output_dir=out)

    def _index(self, job: Job, out: Path) -> None:
        """Add a done document to the search index, in a transaction of its own after the one that marked it done:
        the index is derived from the outbox, so a failure to make or write its entry (the search model missing, a
        damaged index, a full disk) flags it for `npumoed reindex` and fails no document."""
        database = self.local_index if self.queue.shared else self.queue.path
        if database is None:
            return
        try:
            # from the files just written, as `npumoed reindex` reads them: the search model embeds the passages
            write_local(database, IndexEntry.read(out))
        except Exception as e:
            log.warning("job %d: done, but not added to the search index (%s: %s); `npumoed reindex` rebuilds it",
                        job.id, type(e).__name__, e)
            mark_stale(database, f"job {job.id} was not added: {type(e).__name__}: {e}")
