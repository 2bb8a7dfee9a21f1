"""Watching the inbox folders: a file is handed on only once it has stopped changing.

Events (watchdog's native observer, or a polling one for network shares where events never arrive)
only tell the tracker which files to look at; the tracker alone decides when a file is complete: its
size and mtime unchanged for `stable_seconds`. Events get lost (an overflowing event queue, a daemon
that was down), so a full rescan at start and every `rescan_seconds` backs them up.

A file counts as handed on once `on_stable` says its job is committed (else the next rescan offers it
again), and the files handed on are remembered in the queue's database by identity (device, inode,
size, mtime), so a restart does not read and hash an unchanged inbox all over again.

Nothing outside an inbox is ever looked at: symlinked folders are not entered, and a file whose real
parent folder lies outside every inbox is ignored.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Protocol

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver
from watchdog.observers.polling import PollingObserver

from npumoe.jobs.files import Identity, containing_inbox

from .config import InboxConfig
from .intake import is_ignored, iter_documents

log = logging.getLogger(__name__)


class HandedMemory(Protocol):
    """Where the files handed on are remembered across restarts (the queue's `handed` is one)."""

    def all(self) -> dict[str, Identity]: ...

    def remember(self, path: str, identity: Identity) -> None: ...

    def forget(self, paths: Collection[str]) -> None: ...


def signature(path: Path) -> Identity | None:
    """What changes when a file is written to or replaced; None once it is gone (or for a folder).

    Links are not followed: a symlink or a FIFO is handed on as itself, for the daemon to refuse with a reason.
    """
    try:
        s = os.lstat(path)
    except OSError:
        return None
    return None if stat.S_ISDIR(s.st_mode) else Identity.of(s)


class StabilityTracker:
    """Files waiting to be complete: each is ready once its signature has not changed for `stable_seconds`.

    A file handed on is remembered with its signature, so seeing it again (a rescan, a late event) does
    nothing until it changes, unless `unhand` says it was not taken after all. Thread-safe: events arrive
    on the observer's thread.
    """

    def __init__(self, stable_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stable_seconds = stable_seconds
        self.clock = clock
        self._pending: dict[Path, tuple[Identity, float]] = {}  # signature, and since when it has held
        self._handed: dict[Path, Identity] = {}
        self._lock = threading.Lock()

    def remember(self, handed: dict[Path, Identity]) -> None:
        """Files handed on before (by an earlier run): not handed on again unless they changed since."""
        with self._lock:
            self._handed.update(handed)

    def handed_as(self, path: Path) -> Identity | None:
        with self._lock:
            return self._handed.get(path)

    def unhand(self, path: Path) -> None:
        """`path` was not taken after all: the next time it is seen, it waits to be handed on again."""
        with self._lock:
            self._handed.pop(path, None)

    def observe(self, path: Path) -> None:
        current = signature(path)
        with self._lock:
            if current is None:
                self._pending.pop(path, None)
            elif self._handed.get(path) != current:
                waiting = self._pending.get(path)
                if waiting is None or waiting[0] != current:
                    self._pending[path] = (current, self.clock())

    def take_stable(self) -> list[Path]:
        """The files unchanged for long enough, in the order they were first seen; they leave the tracker."""
        with self._lock:
            waiting = list(self._pending.items())
        ready = []
        for path, (seen, _) in waiting:
            current = signature(path)
            now = self.clock()
            with self._lock:
                if path not in self._pending:
                    continue
                since = self._pending[path][1]
                if current is None:
                    del self._pending[path]
                elif current != seen:
                    self._pending[path] = (current, now)
                elif now - since >= self.stable_seconds:
                    del self._pending[path]
                    self._handed[path] = current
                    ready.append(path)
        return ready

    def forget_except(self, present: set[Path]) -> list[Path]:
        """Drop the memory of handed-on files that are no longer there (moved away, deleted); returns them."""
        with self._lock:
            gone = [p for p in self._handed if p not in present]
            for path in gone:
                del self._handed[path]
        return gone

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._pending)


class InboxWatcher:
    """Hands every complete document in the inboxes to `on_stable`, once per content change."""

    def __init__(
        self,
        inboxes: Sequence[Path],
        config: InboxConfig,
        on_stable: Callable[[Path], bool],
        *,
        memory: HandedMemory | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`on_stable(path)` returns whether the file is dealt with (queued, or refused for good)."""
        self.inboxes = [Path(inbox).resolve() for inbox in inboxes]
        self.config = config
        self.on_stable = on_stable
        self.memory = memory
        self.tracker = StabilityTracker(config.stable_seconds, clock)
        if memory is not None:
            self.tracker.remember({Path(path): identity for path, identity in memory.all().items()})
        self.tick_seconds = min(0.5, max(0.05, config.stable_seconds / 4))
        self._observer: BaseObserver | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    # -- one pass at a time: what `run --once` and the background thread both use ------------------------

    def scan(self) -> int:
        """Look at every document in the inboxes (the backstop for lost events); returns how many."""
        present = set()
        for inbox in self.inboxes:
            if not inbox.is_dir():
                log.warning("inbox %s is not a folder; skipping it", inbox)
                continue
            for path in iter_documents([inbox], recursive=self.config.recursive):
                present.add(path)
                self.observe(path)
        gone = self.tracker.forget_except(present)
        if gone and self.memory is not None:
            self.memory.forget([str(path) for path in gone])
        return len(present)

    def observe(self, path: Path) -> None:
        """Note a path an event or a scan reported, if it is a document inside an inbox."""
        if self.admits(path):
            self.tracker.observe(path)

    def hand_on_stable(self) -> int:
        """Pass each file that has become stable to `on_stable`; returns how many."""
        ready = self.tracker.take_stable()
        for path in ready:
            try:
                taken = self.on_stable(path)
                if taken and self.memory is not None and (identity := self.tracker.handed_as(path)):
                    self.memory.remember(str(path), identity)
            except Exception:  # one file must not stop the watching
                log.exception("could not take %s from the inbox", path)
                taken = False
            if not taken:
                self.tracker.unhand(path)
        return len(ready)

    def drain(self, stopping: threading.Event, patience: float | None = None) -> int:
        """Scan once and hand on every file found as it becomes complete (for `run --once`).

        A file still changing after `patience` seconds (default: 10 × stable_seconds, at least 30 s) is left
        for the next run, so a log that is appended to forever cannot hold `--once` up; returns how many.
        """
        patience = max(30.0, 10 * self.config.stable_seconds) if patience is None else patience
        deadline = time.monotonic() + patience
        self.scan()
        while self.tracker.waiting and not stopping.is_set() and time.monotonic() < deadline:
            self.hand_on_stable()
            stopping.wait(self.tick_seconds)
        self.hand_on_stable()
        if left := self.tracker.waiting:
            log.warning("%d file(s) in the inbox are still being written; left for the next run", left)
        return left

    # -- in the background -----------------------------------------------------------------------------

    def start(self) -> None:
        """Watch for events, and scan now and every `rescan_seconds`, on background threads."""
        observer = PollingObserver(timeout=max(1.0, self.tick_seconds)) if self.config.polling else Observer()
        handler = _Events(self)
        for inbox in self.inboxes:
            if inbox.is_dir():
                observer.schedule(handler, str(inbox), recursive=self.config.recursive)
        observer.daemon = True
        observer.start()  # before the first scan, so nothing slips in between the two
        self._observer = observer
        self._thread = threading.Thread(target=self._loop, name="inbox-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=5)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        next_scan = 0.0
        while not self._stopping.is_set():
            try:
                if time.monotonic() >= next_scan:
                    found = self.scan()
                    log.debug("rescanned the inboxes: %d documents", found)
                    next_scan = time.monotonic() + self.config.rescan_seconds
                self.hand_on_stable()
            except Exception:
                log.exception("inbox watcher pass failed; trying again")
            self._stopping.wait(self.tick_seconds)

    def admits(self, path: Path) -> bool:
        """Whether `path` lies inside an inbox, under a name that is not ignored."""
        inbox = containing_inbox(path, self.inboxes)
        if inbox is None:
            return False
        relative = path.parent.resolve().relative_to(inbox) / path.name
        return (self.config.recursive or len(relative.parts) == 1) and not is_ignored(relative)


class _Events(FileSystemEventHandler):
    """Turns watchdog events into paths for the tracker; a folder that arrives whole is scanned."""

    def __init__(self, watcher: InboxWatcher) -> None:
        self.watcher = watcher

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type not in ("created", "modified", "moved", "closed"):
            return
        raw = event.dest_path if event.event_type == "moved" else event.src_path
        path = Path(os.fsdecode(raw))
        if not event.is_directory:
            self.watcher.observe(path)
        elif event.event_type in ("created", "moved") and self.watcher.admits(path):
            for document in iter_documents([path], recursive=self.watcher.config.recursive):
                self.watcher.observe(document)
