"""Faults of the machine, not of the document: which errors they are, and how to tell that one has cleared.

A full disk, a quota, a read-only or failing file system, a network share that went away, a name the file
system will not take, a missing package, the queue's database full, failing or locked for longer than its
busy timeout: none of these says anything about the document, and all of them would hit the next document
the same way. So the job that met one goes back to the queue without spending an attempt (a few times: see
`Queue.hand_back`), and the daemon waits, saying why, until `MachineFault.cleared()` finds the folder usable
again. This module is the one place that decides what counts as such a fault, for OS and database errors alike.
"""

from __future__ import annotations

import errno
import importlib
import importlib.util
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy.exc import DBAPIError

from .errors import MissingDependency
from .outputs import NAME_MAX_BYTES, temporary_path, write_file

# errno -> words for people; the first group is met writing, the second reading (on a network share too).
WRITE_FAULTS = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.ENAMETOOLONG: "file name too long",
}
READ_FAULTS = {errno.EIO: "I/O error", errno.ESTALE: "stale file handle (the network share went away)"}
MACHINE_ERRNOS = WRITE_FAULTS.keys() | READ_FAULTS.keys()
BUSY = {errno.EBUSY: "the database is busy (locked past its busy timeout, or out of connections)"}  # database only
# The database's own errors, by the errno of the same fault: SQLite's result codes (extended ones, such as
# SQLITE_IOERR_WRITE, by their primary), PostgreSQL's SQLSTATE classes (08: connection, 53: out of resources,
# 58: system error).
SQLITE_FAULTS = {"SQLITE_FULL": errno.ENOSPC, "SQLITE_IOERR": errno.EIO, "SQLITE_READONLY": errno.EROFS,
                 "SQLITE_CANTOPEN": errno.EIO, "SQLITE_BUSY": errno.EBUSY, "SQLITE_LOCKED": errno.EBUSY}
POSTGRES_FAULTS = {"53100": errno.ENOSPC, "08": errno.EIO, "53": errno.EBUSY, "58": errno.EIO}
PROBE_BYTES = 1 << 20  # a disk fault has cleared once a file this size can be written again
MIN_FREE_BYTES = 64 << 20  # and, after "disk full", once at least this much is free
OWN_PACKAGE = __name__.partition(".")[0]  # an import of ours that fails is a bug, not a missing dependency


class MachineFault(Exception):
    """The machine, not the document, stopped the job: an OSError in MACHINE_ERRNOS met in `folder`, a
    missing dependency (`module`), or the database's own error (`database`: its file, or "" for a server,
    whose `folder` is None). str() says it for `npumoed status`, e.g. "disk full: 120 MB free in …"."""

    def __init__(self, folder: Path | None, *, code: int | None = None, module: str | None = None,
                 database: str | None = None) -> None:
        self.folder = folder
        self.code = code
        self.module = module
        self.database = database
        super().__init__(self.describe())

    def describe(self) -> str:
        if self.module is not None:
            return f"a dependency is missing: the Python module {self.module!r} cannot be imported"
        code = self.code or 0
        what = WRITE_FAULTS.get(code) or READ_FAULTS.get(code) or BUSY.get(code, "file system error")
        if self.code == errno.ENOSPC and self.folder is not None:
            free = free_bytes(self.folder)
            what += f": {free / 2**20:,.0f} MB free" if free is not None else ""
        if self.database is not None:
            return f"{what} in the queue database{f' {self.database}' if self.database else ''}"
        return f"{what} in {self.folder}"

    def __str__(self) -> str:
        return self.describe()

    def cleared(self) -> bool:
        """Whether the fault has gone: what failed would work now (probed, never assumed)."""
        if self.module is not None:
            importlib.invalidate_caches()  # a package installed since the start is found
            return importlib.util.find_spec(self.module) is not None
        if self.folder is None or self.code == errno.EBUSY:
            return True  # a server's fault, or a lock: nothing here to probe, so the next attempt tells
        if self.code in READ_FAULTS:
            return _can_list(self.folder)
        if self.code == errno.ENAMETOOLONG:
            return _name_max(self.folder) >= NAME_MAX_BYTES
        if self.code == errno.ENOSPC and (free_bytes(self.folder) or 0) < MIN_FREE_BYTES:
            return False
        return _can_write(self.folder)


def machine_fault(error: BaseException, folder: Path, *, database: Path | None = None) -> MachineFault | None:
    """`error` as a MachineFault met in `folder` (or the nearest folder above it that exists), or for an error
    of the database, in `database` (its file; None for a server); None when it is not one, so the caller
    treats it as before."""
    if isinstance(error, MachineFault):
        return error
    if (code := database_errno(error)) is not None:
        where = None if database is None else _existing(database.parent)
        return MachineFault(where, code=code, database=str(database or ""))
    if isinstance(error, MissingDependency) and error.module:
        return MachineFault(folder, module=error.module)
    if isinstance(error, ImportError) and error.name and error.name.partition(".")[0] != OWN_PACKAGE:
        return MachineFault(folder, module=error.name.partition(".")[0])
    if isinstance(error, OSError) and error.errno in MACHINE_ERRNOS:
        return MachineFault(_existing(folder), code=error.errno)
    return None


def database_errno(error: BaseException) -> int | None:
    """The errno of the machine fault that a database error is (SQLite's or PostgreSQL's, raw or as SQLAlchemy
    wraps it); None for any other error, a damaged file (DatabaseUnusable's) or a statement's own error."""
    orig = error.orig if isinstance(error, DBAPIError) else error
    if name := getattr(orig, "sqlite_errorname", None):
        return SQLITE_FAULTS.get("_".join(name.split("_")[:2]))  # SQLITE_IOERR_WRITE by SQLITE_IOERR
    if state := getattr(orig, "sqlstate", None):
        return POSTGRES_FAULTS.get(state) or POSTGRES_FAULTS.get(state[:2])
    return None


@contextmanager
def blamed_on(folder: Path) -> Iterator[None]:
    """Inside: an error that is a machine fault is raised as MachineFault(folder); others pass unchanged."""
    try:
        yield
    except (OSError, ImportError) as e:
        fault = machine_fault(e, folder)
        if fault is None:
            raise
        raise fault from e


def free_bytes(folder: Path) -> int | None:
    """Bytes free to this user in the file system of `folder`; None when it cannot be asked."""
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def _existing(folder: Path) -> Path:
    while not folder.is_dir() and folder.parent != folder:
        folder = folder.parent
    return folder


def _can_list(folder: Path) -> bool:
    try:
        os.listdir(folder)
    except OSError:
        return False
    return True


def _can_write(folder: Path) -> bool:
    probe = temporary_path(folder, "probe")  # a `.tmp-` name: a leftover is cleaned at the next start
    try:
        write_file(probe, bytes(PROBE_BYTES))
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)
    return True


def _name_max(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return NAME_MAX_BYTES  # not asked: assume the usual, and let the next attempt tell
