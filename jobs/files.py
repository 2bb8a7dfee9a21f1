"""Inbox files: the one safe way to open a document, and what becomes of an original once its job is settled.

Every reader of a document (intake hashing it, the pipeline copying it, extraction parsing it) opens it with
`open_regular`, so they refuse the same files for the same reasons, in the same words. Originals are only
ever moved or deleted from inside an inbox (`Folders.holds`): a document queued by hand from elsewhere is
never touched, and one that is no longer the file that was read (`Identity`) is never touched either.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from .errors import FileRefused
from .faults import MACHINE_ERRNOS
from .outputs import move_file, write_file

log = logging.getLogger(__name__)

# What a path is when it is not a regular file, by the type bits of its st_mode.
FILE_KINDS = {
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFDIR: "a folder",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}
# Never follow a link, never wait on a FIFO's writer, never let a terminal become ours, never leak into children.
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_BLOCK_BYTES = 1 << 20
CHANGED = "changed since it was read; left where it is"  # what settle_original says of a replaced file
# What becomes of an original once its document is done (the originals policy).
KEEP, MOVE, DELETE = "keep", "move", "delete"
ORIGINALS = (KEEP, MOVE, DELETE)


@dataclass(frozen=True)
class Identity:
    """Which file a path held, and which version of it: equal identities mean the same, unchanged file."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, status: os.stat_result) -> Identity:
        return cls(status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)

    @classmethod
    def at(cls, path: Path) -> Identity | None:
        """The identity of what is at `path` now (a link as itself); None when nothing is."""
        try:
            return cls.of(os.lstat(path))
        except OSError:
            return None


def open_regular(path: Path, max_bytes: int | None = None, *, empty: bool = True) -> BinaryIO:
    """`path` opened for reading, if it is a regular file of at most `max_bytes` (None: any size), and not
    empty unless `empty` allows it.

    Raises FileRefused saying why not. lstat comes first, so a FIFO or a device is never even opened;
    O_NOFOLLOW and an fstat of the open descriptor close the race with a rename in between. The size is
    judged before a byte is read. A fault of the machine (an I/O error, a stale network share) is raised as
    the OSError it is: it says nothing about the file, and the same file may read fine a minute later.
    """
    try:
        _require_regular(os.lstat(path).st_mode)
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise FileRefused("missing", "the file is gone (deleted or moved away)") from None
    except PermissionError:
        raise FileRefused("unreadable", "cannot read the file: permission denied", denied=True) from None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK):  # what O_NOFOLLOW gives for a link on Linux / on BSD
            raise _not_regular(stat.S_IFLNK) from None
        if e.errno in MACHINE_ERRNOS:
            raise
        raise FileRefused("unreadable", f"cannot open the file: {e.strerror or e}") from None
    file = os.fdopen(fd, "rb")
    try:
        status = os.fstat(fd)
        _require_regular(status.st_mode)
        check_size(status.st_size, max_bytes, empty=empty)
    except BaseException:
        file.close()
        raise
    return file


def check_size(size: int, max_bytes: int | None, *, while_read: bool = False, empty: bool = True) -> None:
    """Refuse (FileRefused) a file of `size` bytes over `max_bytes` (`while_read`: it grew that far), or one of
    0 bytes unless `empty` allows it. The reason names the setting that would let a large file in."""
    if size == 0 and not empty:
        raise FileRefused("empty", "file is empty (0 bytes)")
    if max_bytes is None or size <= max_bytes:
        return
    megabytes = round(max_bytes / 2**20, 3)  # the unit of the `extract.max_mb` setting
    limit = f"{megabytes:g} MB" if megabytes >= 0.1 else f"{max_bytes:,}-byte"
    if while_read:
        raise FileRefused("too_large", f"the file grew past the {limit} limit while it was read (extract.max_mb)")
    raise FileRefused("too_large", f"the file is {size:,} bytes, over the {limit} limit (extract.max_mb)")


def _require_regular(mode: int) -> None:
    if not stat.S_ISREG(mode):
        raise _not_regular(stat.S_IFMT(mode))


def _not_regular(file_type: int) -> FileRefused:
    kind = FILE_KINDS.get(file_type, "of an unknown kind")
    return FileRefused("unreadable", f"the file is {kind}, not a regular file")


def identify(path: Path, max_bytes: int | None = None) -> tuple[str, Identity]:
    """The content hash of a regular file of at most `max_bytes`, and the identity of the file it read;
    FileRefused says why a path is not one."""
    with open_regular(path, max_bytes) as file:
        identity = Identity.of(os.fstat(file.fileno()))
        return hashlib.file_digest(file, "sha256").hexdigest(), identity


def snapshot(source: Path, copy: Path, max_bytes: int) -> tuple[str, Identity]:
    """Copy the document to `copy` (a new private file), hashing it on the way; returns the copy's sha256
    and the identity of the file it was read from (as it was opened: a change while reading shows).

    Raises FileRefused for what `open_regular` refuses, and for a file that grows past `max_bytes` meanwhile.
    """
    digest = hashlib.sha256()
    with open_regular(source, max_bytes) as file:
        identity = Identity.of(os.fstat(file.fileno()))
        out_fd = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(out_fd, "wb") as out:
            copied = 0
            while block := file.read(_BLOCK_BYTES):
                copied += len(block)
                check_size(copied, max_bytes, while_read=True)
                digest.update(block)
                out.write(block)
    return digest.hexdigest(), identity


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


def settle_original(source: Path, originals: str, folders: Folders, identity: Identity) -> str:
    """Keep, move to processed/ or delete a finished document, by policy; returns what happened, in words
    (CHANGED when `source` no longer holds the file of `identity`, the one that was processed).

    Only documents inside an inbox are touched (one queued by hand from elsewhere stays where it is), and a
    failure here is logged, never raised: the job's result is already safe.
    """
    if originals == KEEP or not os.path.lexists(source) or not folders.holds(source):
        return "kept"
    if Identity.at(source) != identity:  # saved again, or replaced, since it was read: not ours to settle
        return CHANGED
    try:
        if originals == DELETE:
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
        write_file(moved.with_name(moved.name + ".error.txt"), report.encode(errors="replace"))
    except OSError as e:
        log.warning("could not move %s to %s: %s", source, folders.failed, e)
        return None
    return moved
