"""One document, start to finish: snapshot → extract → prefill → summary + embeddings → outputs → done.

The worker claims a job and hands it to `Pipeline.process`, which always leaves the job in a settled
state: done, failed (will retry), dead (gave up, original set aside in `failed/` with a `.error.txt`),
or handed back to the queue untouched when the worker is stopping or the model cannot be loaded (the
one exception that escapes, ModelUnavailable, so the worker can wait). No document's failure escapes:
one bad document cannot stop the daemon.

Everything after the snapshot reads a private copy of the document whose hash was checked against the
job, so the outputs always describe exactly the content that was queued.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import re
import shutil
import stat
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from npumoe.jobs.extract import ExtractedText, ExtractionError, ExtractLimits, extract_text
from npumoe.jobs.meta import DocumentMeta, Embeddings, Extraction, Seconds
from npumoe.jobs.outputs import (
    move_file,
    output_name,
    temporary_path,
    write_file,
    write_folder,
)
from npumoe.jobs.queue import Job, Queue

if TYPE_CHECKING:
    from npumoe.engine import DocumentResult, Engine, EngineSettings, Progress

log = logging.getLogger(__name__)

ORIGINALS = ("keep", "move", "delete")
# Extraction failures worth another try: the machine was busy or short of memory. The rest are
# properties of the document and would fail the same way again.
RETRYABLE_EXTRACTION = frozenset({"timeout", "memory"})


class Stop(Exception):
    """Raised between steps when the job must wait (shutdown, its batch window closed): it goes back untouched."""

    def __init__(self, why: str = "the daemon is stopping") -> None:
        super().__init__(why)


class Lost(Exception):
    """The job is no longer this worker's (cancelled by the person, or reaped)."""


class ModelUnavailable(Exception):
    """The model could not be loaded: not the document's fault, so the job is handed back, not failed."""


class Failure(Exception):
    """Why this document did not get outputs; `kind` is recorded with the job."""

    def __init__(self, kind: str, message: str, *, retryable: bool = False, set_aside: bool = True) -> None:
        super().__init__(message)
        self.kind = kind
        self.retryable = retryable
        self.set_aside = set_aside  # once dead, move the original to failed/ (not when it is someone else's now)


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
class Folders:
    outbox: Path
    processed: Path
    failed: Path
    inboxes: tuple[Path, ...]  # resolved; originals are only ever moved or deleted from inside these

    def holds(self, path: Path) -> bool:
        return containing_inbox(path, self.inboxes) is not None


def containing_inbox(path: Path, inboxes: Sequence[Path]) -> Path | None:
    """The (resolved) inbox that really holds `path`: its parent folder resolved, the file itself not followed,
    so neither a symlinked folder nor a `..` leads anywhere else."""
    try:
        parent = path.parent.resolve(strict=True)
    except OSError:
        return None
    return next((inbox for inbox in inboxes if parent.is_relative_to(inbox)), None)


@dataclass(frozen=True)
class Policy:
    originals: str = "keep"  # keep | move | delete, once a document is done
    limits: ExtractLimits = field(default_factory=ExtractLimits)
    lease_seconds: float = 120.0

    def __post_init__(self) -> None:
        if self.originals not in ORIGINALS:
            raise ValueError(f"originals must be one of {', '.join(ORIGINALS)}, got {self.originals!r}")


@dataclass(frozen=True)
class Outcome:
    job_id: int
    state: str  # done | failed | dead | queued (handed back) | lost
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
    ) -> None:
        """`checkpoint` runs between steps and between chunks: it may block (a pause) or raise Stop."""
        self.queue = queue
        self.folders = folders
        self.policy = policy
        self.model = model
        self.pid = worker_pid
        self.meter = meter
        self.checkpoint = checkpoint

    def process(self, job: Job) -> Outcome:
        work = temporary_path(self.folders.outbox, f"job{job.id}")
        try:
            return self._process(job, work)
        except Stop as stop:
            self.queue.release(job.id, self.pid)
            return Outcome(job.id, "queued", f"handed back: {stop}")
        except ModelUnavailable:
            self.queue.release(job.id, self.pid)
            raise
        except Lost:
            return Outcome(job.id, "lost", "cancelled or taken over while it ran")
        except Failure as failure:
            return self._fail(job, failure)
        except Exception as e:  # a bug of ours must not stop the daemon: record it and go on
            log.exception("job %d: unexpected error", job.id)
            return self._fail(job, Failure("internal", f"internal error: {type(e).__name__}: {e}", retryable=True))
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _process(self, job: Job, work: Path) -> Outcome:
        source = Path(job.path)
        finished = self._finished_output(job)
        if finished is not None:  # an earlier attempt wrote everything, then stopped before marking it done
            log.info("job %d: outputs already complete in %s", job.id, finished)
            return self._complete(job, finished, source)

        self._report(job, "reading")
        work.mkdir(mode=0o700)
        copy = work / f"document{_safe_suffix(source)}"
        sha256 = snapshot(source, copy, self.policy.limits.max_bytes)
        if sha256 != job.sha256:
            self._requeue_changed(job, sha256)
        self.checkpoint()

        with self.meter() as meter:
            self._report(job, "extracting")
            started = time.perf_counter()
            extracted = self._extract(copy)
            extract_s = time.perf_counter() - started
            self.checkpoint()
            engine = self.model.load()
            result = self._run_engine(engine, job, extracted.text)

        meta = self._meta(job, source, engine, extracted, result, meter, extract_s)
        files = {
            "summary.md": _summary_markdown(source.name, self.model.settings.model, result).encode(),
            "embeddings.npy": _npy(result.embeddings),
            "meta.json": meta.to_json(),
        }
        out = write_folder(self.folders.outbox, output_name(source.name, job.sha256), files)
        return self._complete(job, out, source)

    def _extract(self, copy: Path) -> ExtractedText:
        try:
            return extract_text(copy, self.policy.limits)
        except ExtractionError as e:
            # A stop signal reaches the extractor too (Ctrl-C, or systemd signalling the whole group): then
            # its death is the stop's doing, not the document's, and the checkpoint hands the job back.
            self.checkpoint()
            raise Failure(e.kind, str(e), retryable=e.kind in RETRYABLE_EXTRACTION) from e

    def _run_engine(self, engine: Engine, job: Job, text: str) -> DocumentResult:
        try:
            return engine.process(text, on_progress=lambda p: self._progress(job, p))
        except (Stop, Lost):
            raise
        except MemoryError as e:
            raise Failure("memory", "the model ran out of memory on this document", retryable=True) from e
        except ValueError as e:  # the engine's word for input it cannot take (empty text, for one)
            raise Failure("engine", f"the engine refused this document: {e}") from e
        except Exception as e:
            raise Failure("engine", f"the engine failed: {type(e).__name__}: {e}", retryable=True) from e

    def _progress(self, job: Job, p: Progress) -> None:
        """After every chunk and every summary step: checkpoint, then record progress (renewing the lease).

        Prefill tokens measure the way through a document: the summary steps between them are counted
        by `step`/`steps`, and the reduce steps that follow the last chunk are short.
        """
        self.checkpoint()
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
        )
        which = f"queued as job #{new.id}" if created else f"already job #{new.id} ({new.state})"
        raise Failure("changed", f"the file changed after it was queued; its new content is {which}", set_aside=False)

    def _finished_output(self, job: Job) -> Path | None:
        out = self.folders.outbox / output_name(Path(job.path).name, job.sha256)
        try:
            meta = json.loads((out / "meta.json").read_bytes())
        except (OSError, ValueError):
            return None
        return out if meta.get("job_id") == job.id and meta.get("sha256") == job.sha256 else None

    def _complete(self, job: Job, out: Path, source: Path) -> Outcome:
        if not self.queue.complete(job.id, self.pid, output_dir=str(out)):
            raise Lost
        settle_original(source, self.policy.originals, self.folders)
        return Outcome(job.id, "done", output_dir=out)

    def _fail(self, job: Job, failure: Failure) -> Outcome:
        reason = str(failure)
        state = self.queue.fail(job.id, self.pid, reason, kind=failure.kind, retryable=failure.retryable)
        if state is None:
            return Outcome(job.id, "lost", "cancelled or taken over while it ran")
        log.warning("job %d %s (%s): %s", job.id, state, failure.kind, reason)
        if state == "dead" and failure.set_aside:
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
            source=str(source),
            sha256=job.sha256,
            job_id=job.id,
            model=settings.model,
            model_key=engine.model_key,
            plan=str(settings.plan) if settings.plan else None,
            backend=settings.backend,
            overflow=settings.overflow,
            dtype=settings.dtype,
            chunk_tokens=stats.chunk_tokens,
            extraction=Extraction(extracted.format, extracted.pages, len(extracted.text)),
            tokens=stats.tokens,
            chunks=stats.chunks,
            sections=stats.sections,
            reduce_rounds=stats.reduce_rounds,
            embeddings=Embeddings(dim=int(result.embeddings.shape[1])),
            seconds=Seconds(extract=round(extract_s, 4), prefill=engine_s["prefill"], summary=engine_s["summary"],
                            reduce=engine_s["reduce"], engine=engine_s["total"], total=round(meter.wall_seconds, 4)),
            cpu_seconds=round(meter.cpu_seconds, 4),
            energy_joules=meter.energy_joules,
            energy_source=meter.energy_source,
            dispatch=stats.dispatch.to_dict(),
            npumoed_version=version("npumoed"),
            created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        )


def snapshot(source: Path, copy: Path, max_bytes: int) -> str:
    """Copy the document to `copy`, hashing it on the way; returns the copy's sha256.

    Never follows a symlink, never blocks on a FIFO, refuses anything but a regular file.
    """
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise Failure("missing", "the file is gone (deleted or moved after it was queued)", set_aside=False) from e
    except PermissionError as e:
        raise Failure("unreadable", "cannot read the file: permission denied", retryable=True) from e
    except OSError as e:
        raise Failure("unreadable", f"cannot open the file: {_open_error(e)}") from e
    digest = hashlib.sha256()
    with os.fdopen(fd, "rb") as f:
        status = os.fstat(f.fileno())
        if not stat.S_ISREG(status.st_mode):
            raise Failure("unreadable", "not a regular file (a folder, FIFO, socket or device)")
        if status.st_size > max_bytes:
            raise Failure("too_large", f"file is {status.st_size:,} bytes, over the {max_bytes:,} limit")
        out_fd = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(out_fd, "wb") as out:
            copied = 0
            while block := f.read(1 << 20):
                copied += len(block)
                if copied > max_bytes:  # it grew while being read
                    raise Failure("too_large", f"file grew past the {max_bytes:,}-byte limit while read")
                digest.update(block)
                out.write(block)
    return digest.hexdigest()


def settle_original(source: Path, originals: str, folders: Folders) -> str:
    """Keep, move to processed/ or delete a finished document, by policy; returns what happened, in words.

    Only documents inside an inbox are touched (one queued by hand from elsewhere stays where it is), and a
    failure here is logged, never raised: the job's result is already safe.
    """
    if originals == "keep" or not os.path.lexists(source) or not folders.holds(source):
        return "kept"
    try:
        if originals == "delete":
            source.unlink()
            return "deleted"
        return f"moved to {move_file(source, folders.processed, source.name)}"
    except OSError as e:
        log.warning("could not %s %s: %s", originals, source, e)
        return f"could not {originals} it: {e.strerror or e}"


def set_aside(source: Path, report: str, folders: Folders) -> Path | None:
    """Move a document that will not be processed into failed/, with `<name>.error.txt` beside it."""
    if not os.path.lexists(source) or not folders.holds(source):
        return None
    try:
        moved = move_file(source, folders.failed, source.name)
        write_file(moved.with_name(moved.name + ".error.txt"), report.encode())
    except OSError as e:
        log.warning("could not move %s to %s: %s", source, folders.failed, e)
        return None
    return moved


def _summary_markdown(name: str, model: str, result: DocumentResult) -> str:
    facts = [f"model `{model}`", f"{result.stats.chunks} chunks", f"{result.stats.tokens} tokens"]
    title = " ".join(name.split())  # no newlines from a hostile file name in the heading
    return f"# {title}\n\n_{' · '.join(facts)}_\n\n{result.summary.strip()}\n"


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(array, dtype=np.float32))
    return buffer.getvalue()


def _safe_suffix(path: Path) -> str:
    """The extension, kept as a hint for extraction, reduced to plain letters and digits."""
    suffix = re.sub(r"[^A-Za-z0-9]", "", path.suffix)[:16]
    return f".{suffix}" if suffix else ""


def _open_error(e: OSError) -> str:
    if e.errno in (errno.ELOOP, errno.EMLINK):  # what O_NOFOLLOW gives for a symlink on Linux / BSD
        return "it is a symbolic link, which npumoed does not follow"
    return e.strerror or str(e)
