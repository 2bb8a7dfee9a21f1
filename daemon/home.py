"""The home folder, where every piece of the daemon's state lives; and the folders documents come from and go
to, which are the home's unless the config names others."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from npumoe.jobs.files import Folders
from npumoe.jobs.outputs import home_mark
from npumoe.jobs.queue.identity import machine_identity

from .config import Config, home_dir


@dataclass(frozen=True)
class Home:
    root: Path

    @classmethod
    def current(cls) -> Home:
        return cls(home_dir())

    @property
    def database(self) -> Path:
        return self.root / "npumoed.db"

    @property
    def lock(self) -> Path:
        """Held by the running daemon (one per home); the kernel lets it go when the process ends."""
        return self.root / "npumoed.lock"

    @property
    def inbox(self) -> Path:
        return self.root / "inbox"

    @property
    def outbox(self) -> Path:
        return self.root / "outbox"

    @property
    def processed(self) -> Path:
        return self.root / "processed"

    @property
    def failed(self) -> Path:
        return self.root / "failed"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def plans(self) -> Path:
        return self.root / "plans"

    @property
    def compiled(self) -> Path:
        return self.root / "compiled"

    @property
    def costs(self) -> Path:
        """Backends' measured costs, per backend, machine and plan: what residency is decided from."""
        return self.root / "costs"

    @property
    def models(self) -> Path:
        return self.root / "models"

    @property
    def reports(self) -> Path:
        return self.root / "reports"

    def ensure(self) -> Home:
        """Create the home's folders, readable by the user only (documents can be private)."""
        old = os.umask(0o077)
        try:
            for folder in (self.root, self.inbox, self.outbox, self.processed, self.failed, self.logs,
                           self.plans, self.compiled, self.costs, self.models, self.reports):
                folder.mkdir(parents=True, exist_ok=True)
        finally:
            os.umask(old)
        return self


def inbox_folders(config: Config, home: Home) -> list[Path]:
    """The watched folders: `[inbox] folders` where set, else the home's own inbox."""
    folders = config.inbox.folders
    return [Path(f).expanduser().resolve() for f in folders] if folders else [home.inbox]


def outbox_folder(config: Config, home: Home) -> Path:
    """Where finished documents' outputs go: `[outbox] folder` (storage several machines share) where set, else
    the home's own outbox."""
    return Path(config.outbox.folder).expanduser().resolve() if config.outbox.folder else home.outbox


def document_folders(config: Config, home: Home, inboxes: Sequence[Path] | None = None) -> Folders:
    """Every folder a document passes through: `inboxes` (else the configured ones), the outbox, and the home's
    processed/ and failed/."""
    watched = [Path(p).resolve() for p in inboxes] if inboxes else inbox_folders(config, home)
    mark = home_mark(machine_identity(home.root)) if config.outbox.folder else ""  # the outbox may be shared
    return Folders(outbox_folder(config, home), home.processed, home.failed, tuple(watched), mark)
