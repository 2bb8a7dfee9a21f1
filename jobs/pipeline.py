"""One document, start to finish: snapshot → extract → prefill → summary + embeddings → outputs → done.

The worker claims a job and hands it to `Pipeline.process`, which always leaves the job in a settled
state: done, failed (will retry), dead (gave up, original set aside in `failed/` with a `.error.txt`),
or handed back to the queue untouched, without spending an attempt, when the worker is stopping, the
model cannot be loaded or the machine failed (disk full, I/O error, the database's own faults: see
faults.py; a few times, then the attempt counts: see `Queue.hand_back`). The last two escape as
ModelUnavailable and MachineFault, so the worker can wait. No document's failure escapes: one bad
document cannot stop the daemon, nor can a database that will not record how a job ended (it is
recorded later, `record_unsettled`).

Everything after the snapshot reads a private copy of the document whose hash was checked against the
job, so the outputs always describe exactly the content that was queued.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from npumoe.engine.vocabulary import PREFILL

from .errors import ExtractionError, Failure, FileRefused, Lost, ModelUnavailable, Stop
from .extract.isolated import ExtractedText, ExtractLimits, extract_text
from .faults import READ_FAULTS, MachineFault, blamed_on, machine_fault
from .files import CHANGED, KEEP, ORIGINALS, Folders, Version, identify, set_aside, settle_original, snapshot
from .meta import DocumentMeta, Embeddings, Extraction, Residency, Seconds, read_meta
from .outputs import (
    EMBEDDINGS_FILE,
    META_FILE,
    OFFSETS_FILE,
    SUMMARY_FILE,
    TEXT_FILE,
    compressed_text,
    npy_bytes,
    output_name,
    temporary_path,
    write_folder,
)
from .queue.schema import DEAD, DONE, QUEUED
from .queue.store import Job, Queue
from .search.index import IndexEntry, mark_stale, write_local

if TYPE_CHECKING:
    from npumoe.engine import DocumentResult, Engine, EngineSettings, Progress

log = logging.getLogger(__name__)

# Extraction failures worth another try: the machine was busy or short of memory. The rest are
# properties of the document and would fail the same way again.
RETRYABLE_EXTRACTION = frozenset({"timeout", "memory"})
LOADING = "loading the model"  # the phase reported while the model loads (it reports no progress meanwhile)


class Model(Protocol):
    """Where the pipeline gets its engine: `load` returns it loaded (or raises ModelUnavailable)."""

    @property
    def settings(self) -> EngineSettings: ...

    def load(self) -> Engine: ...


class Measurement(Protocol):
    cpu_seconds: float
    wall_seconds: float
    energy_joules: float | None
    energy_source: str


@dataclass(frozen=True)
class Policy:
    originals: str = KEEP  # one of ORIGINALS, once a document is done
    limits: ExtractLimits = field(default_factory=ExtractLimits)
    lease_seconds: float = 120.0

    def __post_init__(self) -> None:
        if self.originals not in ORIGINALS:
            raise ValueError(f"originals must be one of {', '.join(ORIGINALS)}, got {self.originals!r}")


@dataclass(frozen=True)
class Outcome:
    job_id: int
    state: str  # done | failed | dead | queued (handed back) | lost | unsettled (its end not recorded yet)
    reason: str = ""
    output_dir: Path | None = None


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
        self.unsettled: dict[int, Callable[[], Outcome]] = {}  # job id -> how it ended, not recorded yet

    def process(self, job: Job) -> Outcome:
        work = temporary_path(self.folders.outbox, f"job{job.id}")
        try:
            return self._process(job, work)
        except Stop as stop:
            return self._record(job, partial(self._release, job, f"handed back: {stop}"))
        except ModelUnavailable:
            self._record(job, partial(self._release, job, "handed back: the model could not be loaded"))
            raise
        except MachineFault as fault:
            return self._hand_back(job, fault)
        except Lost:
            return Outcome(job.id, "lost", "cancelled or taken over while it ran")
        except Failure as failure:
            return self._record(job, partial(self._fail, job, failure))
        except Exception as e:  # a bug of ours must not stop the daemon: record it and go on
            if (fault := self._machine_fault(e)) is not None:
                return self._hand_back(job, fault)
            log.exception("job %d: unexpected error", job.id)
            failure = Failure("internal", f"internal error: {type(e).__name__}: {e}", retryable=True)
            return self._record(job, partial(self._fail, job, failure))
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def record_unsettled(self) -> None:
        """Record the ends of jobs the database would not take when they ended (the worker calls this before it
        claims the next job); one it still will not take waits for the next call, and a machine fault is raised."""
        for job_id, settle in list(self.unsettled.items()):
            try:
                outcome = settle()
            except Exception as e:
                if (fault := self._machine_fault(e)) is not None:
                    raise fault from e
                log.warning("job %d: its end still cannot be recorded: %s: %s", job_id, type(e).__name__, e)
                continue
            del self.unsettled[job_id]
            log.info("job %d: recorded at last as %s", job_id, outcome.state)

    def _record(self, job: Job, settle: Callable[[], Outcome]) -> Outcome:
        """Record how the job ended: `settle` writes it to the queue, its values bound, as it may run again. When
        the database will not take it (full, locked, its server gone), the daemon goes on: the job stays leased to
        this worker, `record_unsettled` writes its end later, and a machine fault is raised for the worker to wait
        on."""
        try:
            return settle()
        except Exception as e:
            self.unsettled[job.id] = settle
            fault = self._machine_fault(e)
            log.warning("job %d: how it ended could not be recorded yet (%s); tried again later", job.id,
                        fault or f"{type(e).__name__}: {e}")
            if fault is not None:
                raise fault from e
            return Outcome(job.id, "unsettled", f"not recorded yet: {e}")

    def _machine_fault(self, error: BaseException) -> MachineFault | None:
        return machine_fault(error, self.folders.outbox, database=self.queue.path)

    def _release(self, job: Job, reason: str) -> Outcome:
        self.queue.release(job.id, self.pid)
        return Outcome(job.id, QUEUED, reason)

    def _hand_back(self, job: Job, fault: MachineFault) -> Outcome:
        """Hand the job back for a machine fault. While that costs no attempt, the fault is raised for the worker
        to wait until it has cleared; once it keeps coming back though the machine probes well (see
        `Queue.hand_back`), it is likely the file's, and the attempt it spent is an outcome like any failure."""
        outcome = self._record(job, partial(self._handed_back, job, fault))
        if outcome.state == QUEUED:
            raise fault
        return outcome

    def _handed_back(self, job: Job, fault: MachineFault) -> Outcome:
        state = self.queue.hand_back(job.id, self.pid, str(fault))
        if state is None:
            return Outcome(job.id, "lost", "cancelled or taken over while it ran")
        if state == QUEUED:
            return Outcome(job.id, QUEUED, f"handed back: {fault}")
        again = Failure("machine", f"{fault}, each time it was tried, while the machine itself was found working")
        return self._settled(job, state, again)

    def _process(self, job: Job, work: Path) -> Outcome:
        source = Path(job.path)
        finished = self._finished_output(job)
        if finished is not None:  # an earlier attempt wrote everything, then stopped before marking it done
            log.info("job %d: outputs already complete in %s", job.id, finished)
            return self._complete(job, finished, source, identity=None)

        self._report(job, "reading")
        work.mkdir(mode=0o700)
        copy = work / f"document{_safe_suffix(source)}"
        sha256, identity = self._snapshot(source, copy)
        if sha256 != job.sha256:
            self._requeue_changed(job, sha256)
        self.checkpoint()

        with self.meter() as meter:
            self._report(job, "extracting")
            started = time.perf_counter()
            extracted = self._extract(copy)
            extract_s = time.perf_counter() - started
            self.checkpoint()
            self._report(job, LOADING)
            engine = self.model.load()
            result = self._run_engine(engine, job, extracted.text)

        meta = self._meta(job, source, engine, extracted, result, meter, extract_s)
        files = {
            SUMMARY_FILE: _summary_markdown(source.name, self.model.settings.model, result).encode(),
            EMBEDDINGS_FILE: npy_bytes(np.asarray(result.embeddings, dtype=np.float32)),
            OFFSETS_FILE: npy_bytes(np.asarray(result.spans, dtype=np.int64)),
            TEXT_FILE: compressed_text(extracted.text),
            META_FILE: meta.to_json(),
        }
        with blamed_on(self.folders.outbox):
            name = output_name(source.name, job.sha256, job.model_key, job.settings_key)
            out = write_folder(self.folders.outbox, name, files)
        return self._complete(job, out, source, identity)

    def _snapshot(self, source: Path, copy: Path) -> tuple[str, Version]:
        try:
            return snapshot(source, copy, self.policy.limits.max_bytes)
        except OSError as e:  # reading the document failed (its folder's fault), or writing the copy (the outbox's)
            fault = machine_fault(e, source.parent if e.errno in READ_FAULTS else self.folders.outbox)
            if fault is None:
                raise
            raise fault from e
        except FileRefused as refused:
            raise _failure(refused) from refused

    def _extract(self, copy: Path) -> ExtractedText:
        try:
            return extract_text(copy, self.policy.limits)
        except ExtractionError as e:
            # A stop signal reaches the extractor too (Ctrl-C, or systemd signalling the whole group): then
            # its death is the stop's doing, not the document's, and the checkpoint hands the job back.
            self.checkpoint()
            raise _failure(e) from e

    def _run_engine(self, engine: Engine, job: Job, text: str) -> DocumentResult:
        self.progressed(PREFILL)  # the model is loaded: from now on, a job that does not move has stalled
        try:
            return engine.process(text, on_progress=lambda p: self._progress(job, p), check=self.checkpoint)
        except (Stop, Lost, Failure):  # raised by the checkpoint within the engine: the worker's, not the engine's
            raise
        except MemoryError as e:
            raise Failure("memory", "the model ran out of memory on this document", retryable=True) from e
        except ValueError as e:  # the engine's word for input it cannot take (empty text, for one)
            raise Failure("engine", f"the engine refused this document: {e}") from e
        except Exception as e:
            raise Failure("engine", f"the engine failed: {type(e).__name__}: {e}", retryable=True) from e

    def _progress(self, job: Job, p: Progress) -> None:
        """After every chunk and every summary step: record progress (renewing the lease).

        Prefill tokens measure the way through a document: the summary steps between them are counted
        by `step`/`steps`, and the reduce steps that follow the last chunk are short.
        """
        rate = p.tokens_done / p.elapsed_s if p.elapsed_s > 0 else None
        eta = (p.tokens_total - p.tokens_done) / rate if rate else None
        done = min(p.tokens_done / p.tokens_total, 0.99) if p.tokens_total else 0.0
        self._report(
            job,
            p.phase,
            progress=done,
            step=p.chunks_done,
            steps=p.chunks_total,
            tokens_done=p.tokens_done,
            tokens_total=p.tokens_total,
            tokens_per_s=rate,
            eta_s=eta,
        )

    def _report(self, job: Job, phase: str, *, progress: float | None = None, **detail: Any) -> None:
        self.progressed(phase)
        if not self.queue.heartbeat(
            job.id,
            self.pid,
            lease_seconds=self.policy.lease_seconds,
            progress=progress,
            detail={"phase": phase, **detail},
        ):
            raise Lost

    def _requeue_changed(self, job: Job, sha256: str) -> None:
        """The file was rewritten after it was queued: its new content is a new job, and this one ends."""
        new, created = self.queue.add(
            job.path,
            sha256,
            model_key=job.model_key,
            settings_key=job.settings_key,
            priority=job.priority,
            max_attempts=job.max_attempts,
            batch_window=job.batch_window,
            pinned=True,  # the content was read here: on a shared queue it is this machine's file, whatever the path
        )
        which = f"queued as job #{new.id}" if created else f"already job #{new.id} ({new.state})"
        raise Failure("changed", f"the file changed after it was queued; its new content is {which}", set_aside=False)

    def _finished_output(self, job: Job) -> Path | None:
        out = self.folders.outbox / output_name(Path(job.path).name, job.sha256, job.model_key, job.settings_key)
        try:
            meta = read_meta(out)
        except ValueError:
            return None
        return out if (meta["job_id"], meta["sha256"]) == (job.id, job.sha256) else None

    def _complete(self, job: Job, out: Path, source: Path, identity: Version | None) -> Outcome:
        """Mark the job done, index its outputs, then settle the original: only the very file that was read
        (`identity`; None when this attempt did not read it), and a file saved again meanwhile is queued as a new
        document instead."""
        if not self.queue.complete(job.id, self.pid, output_dir=str(out)):
            raise Lost
        self._index(job, out)
        self.settle(job, source, identity)
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

    def settle(self, job: Job, source: Path, identity: Version | None = None) -> None:
        """Keep, move or delete the original of the done `job` by policy, if `source` still holds its content."""
        if self.policy.originals == KEEP:
            return
        if identity is None:
            identity = self._identify_as(job, source)
            if identity is None:
                return
        if settle_original(source, self.policy.originals, self.folders, identity) == CHANGED:
            log.info("job %d: %s changed after it was read; not %s", job.id, source, self.policy.originals)
            self._identify_as(job, source)

    def _identify_as(self, job: Job, source: Path) -> Version | None:
        """The identity of `source` if it still holds the content of `job`; otherwise its new content is queued
        (as `_requeue_changed` would) and None returned, and so is None for a file that can no longer be read."""
        try:
            sha256, identity = identify(source, self.policy.limits.max_bytes)
        except (OSError, ValueError) as e:
            log.info("job %d: %s not settled: %s", job.id, source, e)
            return None
        if sha256 == job.sha256:
            return identity
        try:
            self._requeue_changed(job, sha256)
        except Failure as changed:
            log.info("job %d: %s", job.id, changed)
        return None

    def _fail(self, job: Job, failure: Failure) -> Outcome:
        state = self.queue.fail(job.id, self.pid, str(failure), kind=failure.kind, retryable=failure.retryable)
        if state is None:
            return Outcome(job.id, "lost", "cancelled or taken over while it ran")
        return self._settled(job, state, failure)

    def _settled(self, job: Job, state: str, failure: Failure) -> Outcome:
        """The outcome of a job the queue recorded as `state` (failed or dead) for `failure`; a dead one's
        original is set aside with the reason."""
        reason = str(failure)
        log.warning("job %d %s (%s): %s", job.id, state, failure.kind, reason)
        if state == DEAD and failure.set_aside:
            set_aside(
                Path(job.path),
                f"job #{job.id} gave up after {job.attempts} attempt(s)\nkind: {failure.kind}\nreason: {reason}\n",
                self.folders,
            )
        return Outcome(job.id, state, reason)

    def _meta(
        self,
        job: Job,
        source: Path,
        engine: Engine,
        extracted: ExtractedText,
        result: DocumentResult,
        meter: Measurement,
        extract_s: float,
    ) -> DocumentMeta:
        settings, stats = self.model.settings, result.stats
        engine_s = {phase: round(seconds, 4) for phase, seconds in stats.seconds.items()}
        return DocumentMeta(
            source=_readable(str(source)),
            sha256=job.sha256,
            job_id=job.id,
            model=settings.model,
            model_key=engine.model_key,
            plan=str(settings.plan) if settings.plan else None,
            backend=settings.backend,
            overflow=settings.overflow,
            weights=engine.settings.weights,  # what the engine loaded: auto is decided at load
            dtype=engine.settings.dtype,
            chunk_tokens=stats.chunk_tokens,
            residency=_residency(engine),
            extraction=Extraction(extracted.format, extracted.pages, len(extracted.text)),
            tokens=stats.tokens,
            chunks=stats.chunks,
            sections=stats.sections,
            reduce_rounds=stats.reduce_rounds,
            generated_tokens=stats.generated_tokens,
            embeddings=Embeddings(dim=int(result.embeddings.shape[1]), pooling=engine.settings.pooling),
            seconds=Seconds(extract=round(extract_s, 4), prefill=engine_s["prefill"], summary=engine_s["summary"],
                            reduce=engine_s["reduce"], engine=engine_s["total"], total=round(meter.wall_seconds, 4)),
            cpu_seconds=round(meter.cpu_seconds, 4),
            energy_joules=meter.energy_joules,
            energy_source=meter.energy_source,
            dispatch=stats.dispatch.to_dict(),
            npumoed_version=version("npumoed"),
            created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        )


def _failure(error: ExtractionError) -> Failure:
    """The job's failure for a document that yielded no text, its kind and reason as they were raised. Retried
    when the machine was busy or short of memory, or a permission refused it (a person may put that right); a
    file gone is no longer anyone's to set aside."""
    denied = isinstance(error, FileRefused) and error.denied
    return Failure(error.kind, str(error), retryable=error.kind in RETRYABLE_EXTRACTION or denied,
                   set_aside=error.kind != "missing")


def _readable(text: str) -> str:
    """`text` as valid Unicode: the bytes of a name that is not UTF-8 (surrogate escapes) shown as \\xNN."""
    return os.fsencode(text).decode("utf-8", "backslashreplace")


def _residency(engine: Engine) -> Residency:
    placed = engine.residency
    if placed is None:  # no plan: every expert on the exact CPU path
        return Residency(accelerator_groups=0, cpu_groups=0, measured_on=None, fallback=None)
    return Residency(accelerator_groups=placed.accelerator_groups, cpu_groups=placed.cpu_groups,
                     measured_on=placed.measured_on, fallback=placed.fallback)


def _summary_markdown(name: str, model: str, result: DocumentResult) -> str:
    facts = [f"model `{model}`", f"{result.stats.chunks} chunks", f"{result.stats.tokens} tokens"]
    title = " ".join(_readable(name).split())  # no newlines from a hostile file name in the heading
    return f"# {title}\n\n_{' · '.join(facts)}_\n\n{result.summary.strip()}\n"


def _safe_suffix(path: Path) -> str:
    """The extension, kept as a hint for extraction, reduced to plain letters and digits."""
    suffix = re.sub(r"[^A-Za-z0-9]", "", path.suffix)[:16]
    return f".{suffix}" if suffix else ""
