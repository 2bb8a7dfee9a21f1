"""Turning paths into jobs: which files count as documents, their content hash, the dedupe keys, and the inbox
intake (what the watcher hands over is queued, or set aside with the reason it cannot be)."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from npumoe.engine.vocabulary import MEAN
from npumoe.jobs.errors import MISSING, FileRefused
from npumoe.jobs.faults import machine_fault
from npumoe.jobs.files import Folders, identify, real_folder, set_aside
from npumoe.jobs.queue.schema import DEAD, DONE, FAILED, QUEUED, RUNNING
from npumoe.jobs.queue.store import CLAIMABLE, INTERACTIVE, Job, Queue
from npumoe.jobs.results import finished_output

from .config import Config
from .model_choice import DEMO, output_settings

log = logging.getLogger(__name__)

# Files that editors, browsers and the Finder leave behind while they work, and never documents.
IGNORED = (".*", "~$*", "*~", "*.part", "*.crdownload", "*.download", "*.tmp", "*.temp", "*.swp",
           "*.partial", "Thumbs.db", "desktop.ini", "Icon\r")


def is_ignored(path: Path) -> bool:
    """Hidden, temporary or partial: any part of the path named like that (`.Trashes/x` too)."""
    return any(fnmatch.fnmatchcase(part, pattern) for part in path.parts[-8:] for pattern in IGNORED)


def iter_documents(paths: Iterable[Path], *, recursive: bool = True) -> Iterator[Path]:
    """Regular files under `paths`, skipping ignored names; symlinked folders are not entered."""
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            walker = os.walk(path) if recursive else [next(os.walk(path), (str(path), [], []))]
            for root, dirs, files in walker:
                dirs[:] = sorted(d for d in dirs if not is_ignored(Path(d)))
                for name in sorted(files):
                    candidate = Path(root) / name
                    if not is_ignored(candidate.relative_to(path)):
                        yield candidate
        elif not is_ignored(Path(path.name)):
            yield path


def sha256_of(path: Path, max_bytes: int | None = None) -> str:
    """The content hash of a regular file of at most `max_bytes`; FileRefused says why a path is not one.
    `path` is a person's: links in its folder are followed, the file itself never is."""
    return identify(real_folder(path), max_bytes)[0]


def job_keys(config: Config) -> tuple[str, str]:
    """(model_key, settings_key): the same document under the same model and settings is one job."""
    m = config.model
    folder = Path(m.name).expanduser()
    model = str(folder.resolve()) if m.name != DEMO and folder.is_dir() else m.name
    settings = {**output_settings(config), "plan": _file_digest(m.plan)}  # a plan by its content, not its name
    if m.pooling == MEAN:  # left out: the jobs of every config from before there was a choice keep their keys
        del settings["pooling"]
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    return model, digest


def _file_digest(path: str) -> str:
    return sha256_of(Path(path).expanduser()) if path else ""


def enqueue(queue: Queue, path: Path, config: Config, *, priority: int = INTERACTIVE,
            batch_window: str | None = None, pinned: bool = False) -> tuple[Job, bool]:
    """Queue one document; a file over `extract.max_mb` is refused before it is read (hashing costs a full read).

    `pinned`: the file is this machine's own (an inbox), so on a shared queue only this machine may take it; so
    is every file outside `queue.shared_folders`.

    Raises FileRefused for a path that is no document (a link, a FIFO, too large, gone).
    """
    # The folder resolved, never the file itself: a link (a looping one too) or a FIFO is refused before
    # anything follows it, and from now on a link anywhere on the recorded path is refused (open_regular).
    where = real_folder(path)
    sha256 = identify(where, int(config.extract.max_mb * 2**20))[0]
    model_key, settings_key = job_keys(config)
    return queue.add(where, sha256, model_key=model_key, settings_key=settings_key,
                     priority=priority, max_attempts=config.queue.max_attempts, batch_window=batch_window,
                     pinned=pinned or not config.queue.is_shared(where))


def content_now(job: Job, config: Config, inboxes: Iterable[Path], given: Path | None = None) -> Path | None:
    """Where the job's content is now, when its own file no longer holds it (renamed, deleted while a copy waited):
    `given` if it holds that content (else FileRefused or ValueError say why not), or else the first document in
    `inboxes` that does. None: the job's own file still holds it, or no file could be found that does."""
    max_bytes = int(config.extract.max_mb * 2**20)
    if given is not None:
        if sha256_of(given, max_bytes) != job.sha256:
            raise ValueError(f"{given} does not hold the content of job {job.id}")
        return real_folder(given)
    if _holds(job, max_bytes):
        return None
    for path in iter_documents(inboxes, recursive=config.inbox.recursive):
        if _holds(job, max_bytes, path):
            return real_folder(path)
    return None


def _holds(job: Job, max_bytes: int, path: Path | None = None) -> bool:
    """Whether `path` (by default the job's own file) is there and holds the job's content."""
    try:
        return sha256_of(path or Path(job.path), max_bytes) == job.sha256
    except (OSError, ValueError):
        return False


@dataclass
class Enqueued:
    """What `enqueue_paths` made of its paths."""

    jobs: list[tuple[Job, bool]] = field(default_factory=list)  # (job, created now) per document queued or known
    problems: list[str] = field(default_factory=list)  # "path: why" per document that could not be queued

    @property
    def failed(self) -> bool:
        """Every document was refused (and there was at least one)."""
        return bool(self.problems) and not self.jobs


def enqueue_paths(queue: Queue, paths: Iterable[Path], config: Config, *, priority: int = INTERACTIVE,
                  batch_window: str | None = None,
                  on_job: Callable[[Path, Job, bool], None] | None = None) -> Enqueued:
    """Queue every document under `paths` (folders searched as `inbox.recursive` says); one that cannot be
    queued is noted and the rest go on. `on_job(path, job, created)` runs as each document is queued."""
    enqueued = Enqueued()
    for path in iter_documents(paths, recursive=config.inbox.recursive):
        try:
            job, created = enqueue(queue, path, config, priority=priority, batch_window=batch_window)
        except (OSError, ValueError) as e:
            enqueued.problems.append(f"{path}: {e}")
            continue
        enqueued.jobs.append((job, created))
        if on_job is not None:
            on_job(path, job, created)
    return enqueued


class InboxIntake:
    """The watcher's hand-over (called on its thread): a document found complete in an inbox is queued, pinned to
    this machine (its inbox, its file), or set aside in failed/ with the reason it cannot be."""

    def __init__(self, queue: Queue, config: Config, folders: Folders, *, settle: Callable[[Job, Path], None],
                 queued: Callable[[], None]) -> None:
        self.queue = queue
        self.config = config
        self.folders = folders
        self.settle = settle  # the original of a document finished before: kept, moved or deleted by policy
        self.queued = queued  # a new job: ends the worker's idle wait
        self.rejected = 0  # files that could not even be queued (links, FIFOs, unreadable)
        self._copies: dict[int, set[Path]] = {}  # job id → copies of its document waiting for its end
        self._lock = threading.Lock()  # taken on the watcher's thread, rechecked on the worker's

    def take(self, path: Path) -> bool:
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
            if isinstance(e, FileRefused) and e.kind == MISSING:
                log.info("%s disappeared before it could be queued", path)
                return True
            if isinstance(e, FileRefused) and e.denied:  # a person may put that right: offered again at the rescan
                log.warning("not queued yet: %s: %s", path, e)
                return False
            log.warning("not queued: %s: %s", path, e)
            set_aside(path, f"not queued: {e}\n", self.folders)
            self.rejected += 1
            return True
        if created:
            log.info("queued job %d: %s", job.id, path)
            self.queued()
            return True
        return self._known(job, real_folder(path))

    def _known(self, job: Job, path: Path) -> bool:
        """A document whose content is the known `job`'s: settled if that job is done and its outputs are in this
        machine's outbox; otherwise the job follows its content here when it needs to (its outputs are gone, its
        own file was renamed or deleted, it died because that file was gone). A copy waiting behind the job's own
        file is not dealt with yet: the job's end offers it again (`recheck`), and so does every rescan."""
        if job.state == DONE and finished_output(self.folders.outbox, job) is not None:
            self.settle(job, path)  # finished earlier, e.g. stopped between "done" and moving the original
            return True
        lost_without_it = job.state == DONE or (job.state == DEAD and job.error_kind == MISSING)
        if job.state != RUNNING and (lost_without_it or not _holds(job, int(self.config.extract.max_mb * 2**20))):
            followed = self.queue.follow(job.id, job.path, path, pinned=True)
            if followed is not None:
                log.info("job %d follows its content to %s (%s)", job.id, path, followed.state)
                if followed.state in CLAIMABLE:
                    self.queued()
                return True
        if str(path) == job.path or job.state not in (QUEUED, FAILED, RUNNING):
            return True
        with self._lock:
            self._copies.setdefault(job.id, set()).add(path)
        return False

    def recheck(self, job_id: int) -> None:
        """The job `job_id` ended: the copies of its document that waited for it are taken again."""
        with self._lock:
            copies = self._copies.pop(job_id, set())
        for path in sorted(copies):
            self.take(path)
