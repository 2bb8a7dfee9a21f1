"""Inbox files: the one safe way to open a document, and what becomes of an original once its job is settled.

Every reader of a document (intake hashing it, the pipeline copying it, extraction parsing it) opens it with
`open_regular`, so they refuse the same files for the same reasons, in the same words. Originals are only
ever moved or deleted from inside an inbox (`Folders.holds`): a document queued by hand from elsewhere is
never touched, and one that is no longer the very version that was read (`Version`) is never touched either.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import shutil
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from .errors import FileRefused
from .faults import MACHINE_ERRNOS
from .outputs import fsync_dir, temporary_path, write_file

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
# The folders on a path, walked one by one: O_PATH (Linux) needs no read permission, as a lookup by path does not.
_FOLDER_FLAGS = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_BLOCK_BYTES = 1 << 20
SET_ASIDE = ".npumoed-failed"
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


@dataclass(frozen=True)
class Version(Identity):
    """An Identity that also tells an in-place rewrite from the file that was read: the ctime moves with every
    write and every change of metadata, and unlike the mtime nothing can set it back. What a reader returns,
    and what an original must still be before it is moved or deleted; the watcher's memory needs only Identity.
    """

    ctime_ns: int

    @classmethod
    def of(cls, status: os.stat_result) -> Version:
        return cls(status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns)


def open_regular(path: Path, max_bytes: int | None = None, *, empty: bool = True) -> BinaryIO:
    """`path` opened for reading, if it is a regular file of one name, of at most `max_bytes` (None: any size),
    and not empty unless `empty` allows it.

    Raises FileRefused saying why not. No link is followed anywhere on the path: a document's path is recorded
    with its folder resolved (`real_folder`), so a link on it now is a folder swapped for one since. lstat
    comes first, so a FIFO or a device is never even opened; O_NOFOLLOW and an fstat of the open descriptor
    close the race with a rename in between. A file with other hard links is refused: another name of it may
    be anywhere. The size is judged before a byte is read. A fault of the machine (an I/O error, a stale
    network share) is raised as the OSError it is: it says nothing about the file, and the same file may read
    fine a minute later.
    """
    try:
        fd = _open_walking(path)
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
        if status.st_nlink > 1:
            raise FileRefused("unreadable", f"the file has {status.st_nlink} hard links; only a file with a single "
                                            "name is read")
        check_size(status.st_size, max_bytes, empty=empty)
    except BaseException:
        file.close()
        raise
    return file


def real_folder(path: Path) -> Path:
    """`path` with its folder resolved (every link in it followed) and the file itself not: how a document's
    path is recorded, and what a reader of a path given by a person opens."""
    return path.parent.resolve() / path.name


def _open_walking(path: Path) -> int:
    """`path` opened with _OPEN_FLAGS, each folder on the way opened relative to the one before it and never
    followed if it is a link (O_NOFOLLOW alone covers only the last name)."""
    try:
        at = _walk_to_folder(path)
    except LinkOnPath:
        raise FileRefused("unreadable", "a folder on its path is a symbolic link, not a folder") from None
    try:
        _require_regular(os.stat(path.name, dir_fd=at, follow_symlinks=False).st_mode)
        return os.open(path.name, _OPEN_FLAGS, dir_fd=at)
    finally:
        os.close(at)


class LinkOnPath(OSError):
    """A folder on a document's path is a symbolic link: a folder swapped for one since the path was recorded."""

    def __init__(self) -> None:
        super().__init__(errno.ELOOP, "a folder on its path is a symbolic link, not a folder")


def _walk_to_folder(path: Path) -> int:
    """The folder holding `path`, opened with _FOLDER_FLAGS, each folder on the way opened relative to the one
    before it and never followed if it is a link (LinkOnPath)."""
    *folders, _ = path.parts
    at = os.open("." if not path.anchor else folders.pop(0), _FOLDER_FLAGS)
    try:
        for folder in folders:
            try:
                inner = os.open(folder, _FOLDER_FLAGS, dir_fd=at)
            except OSError as e:
                if e.errno in (errno.ENOTDIR, errno.ELOOP, errno.EMLINK) and _is_link(folder, at):
                    raise LinkOnPath from None
                raise
            os.close(at)
            at = inner
    except BaseException:
        os.close(at)
        raise
    return at


@dataclass(frozen=True)
class _Entry:
    """A name in a folder held open: what is done to it by name stays in that folder, even if a folder on
    its path is swapped for a link meanwhile (in an inbox others can write to, that would redirect a move
    or a delete to a file of the same name anywhere)."""

    folder: int
    name: str

    def lstat(self) -> os.stat_result:
        return os.stat(self.name, dir_fd=self.folder, follow_symlinks=False)

    def version(self) -> Version | None:
        try:
            return Version.of(self.lstat())
        except OSError:
            return None

    def open(self) -> int:
        return os.open(self.name, _OPEN_FLAGS, dir_fd=self.folder)

    def rename(self, target: Path) -> None:
        os.rename(self.name, target, src_dir_fd=self.folder)

    def unlink(self) -> None:
        os.unlink(self.name, dir_fd=self.folder)


@contextmanager
def _entry(path: Path) -> Iterator[_Entry]:
    """`path` as an _Entry of its folder, walked to without following a link (LinkOnPath if one is on it)."""
    at = _walk_to_folder(path)
    try:
        yield _Entry(at, path.name)
    finally:
        os.close(at)


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


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


def identify(path: Path, max_bytes: int | None = None) -> tuple[str, Version]:
    """The content hash of a regular file of at most `max_bytes`, and the version of the file it read;
    FileRefused says why a path is not one."""
    with open_regular(path, max_bytes) as file:
        identity = Version.of(os.fstat(file.fileno()))
        return hashlib.file_digest(file, "sha256").hexdigest(), identity


def snapshot(source: Path, copy: Path, max_bytes: int) -> tuple[str, Version]:
    """Copy the document to `copy` (a new private file), hashing it on the way; returns the copy's sha256
    and the version of the file it was read from (as it was opened: a change while reading shows).

    Raises FileRefused for what `open_regular` refuses, and for a file that grows past `max_bytes` meanwhile.
    """
    digest = hashlib.sha256()
    with open_regular(source, max_bytes) as file:
        identity = Version.of(os.fstat(file.fileno()))
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
    mark: str = ""  # on this home's temporary names in an outbox other homes share (outputs.temporary_path)

    def holds(self, path: Path) -> bool:
        return containing_inbox(path, self.inboxes) is not None

    @property
    def work(self) -> Path:
        """Where a job's private files (the document's copy) are made: the home, which holds processed/ and
        failed/ and is swept of what a killed run left at every start; never the outbox, which may be storage
        other machines share and no start sweeps."""
        return self.failed.parent


def containing_inbox(path: Path, inboxes: Sequence[Path]) -> Path | None:
    """The (resolved) inbox that really holds `path`: its parent folder resolved, the file itself not followed,
    so neither a symlinked folder nor a `..` leads anywhere else."""
    try:
        parent = path.parent.resolve(strict=True)
    except OSError:
        return None
    return next((inbox for inbox in inboxes if parent.is_relative_to(inbox)), None)


def settle_original(source: Path, originals: str, folders: Folders, version: Version) -> str:
    """Keep, move to processed/ or delete a finished document, by policy; returns what happened, in words
    (CHANGED when `source` no longer holds `version`, the one that was processed, or changed while moved).

    Only documents inside an inbox are touched (one queued by hand from elsewhere stays where it is), and a
    failure here is logged, never raised: the job's result is already safe.
    """
    if originals == KEEP or not os.path.lexists(source) or not folders.holds(source):
        return "kept"
    try:
        if originals == DELETE:
            with _entry(source) as entry:
                if entry.version() != version:  # saved again, or replaced, since it was read: not ours to settle
                    return CHANGED
                entry.unlink()
            return "deleted"
        moved = move_file(source, folders.processed, source.name, version)
        return CHANGED if moved is None else f"moved to {moved}"
    except OSError as e:
        log.warning("could not %s %s: %s", originals, source, e)
        return f"could not {originals} it: {e.strerror or e}"


def move_file(source: Path, folder: Path, name: str, version: Version | None = None, *,
              copy: bool = True) -> Path | None:
    """Move `source` into `folder` under `name` (or a free variant of it); returns where it went, or None when
    it is not `version` (None: any) or changed while it was copied. Then it stays where it is, untouched.
    Without `copy`, a move that is no rename raises the OSError (EXDEV) the rename did.

    The destination is claimed first (`_claim_free_name`), so two movers never land on one name. Then a rename
    when both sides share a file system. Otherwise the very descriptor that was checked is copied under a
    temporary name, flushed to disk and renamed onto the claimed name, and the source is removed only if it
    is still that version afterwards: a save during the copy is never lost. (Between that last look and the
    unlink a save can still slip in: no system call removes a name only if it still holds a given inode.)
    Every step acts on the name inside its folder, held open (`_entry`): a folder on the path swapped for a
    link meanwhile redirects none of them.
    """
    with _entry(source) as entry:
        fd = _open_to_move(entry)
        if fd is None:  # a link, a FIFO or an unreadable file: what was read (`version`) it is not
            return None if version is not None else _move_entry(entry, folder, name, copy=copy)
        with os.fdopen(fd, "rb") as file:
            read = Version.of(os.fstat(file.fileno()))
            if version is not None and read != version:
                return None
            with _claim_free_name(folder, name) as target:
                try:
                    entry.rename(target)
                    return target
                except OSError as e:
                    if e.errno != errno.EXDEV or not copy:
                        raise
                _copy_durably(file, target)
                if Version.of(os.fstat(file.fileno())) != read or entry.version() != read:  # written to, or replaced
                    target.unlink()
                    fsync_dir(folder)
                    return None
        entry.unlink()
    fsync_dir(source.parent)
    return target


def _open_to_move(entry: _Entry) -> int | None:
    """A descriptor of the regular file `entry`; None for anything else, or one this process cannot read."""
    if not stat.S_ISREG(entry.lstat().st_mode):
        return None
    try:
        return entry.open()
    except OSError:  # no permission, an I/O error: being set aside for it, it can still be renamed, not copied
        return None


def _copy_durably(file: BinaryIO, target: Path) -> None:
    """Copy the open `file` to `target` (which must not exist) as a whole, on disk, with its mode and times."""
    status = os.fstat(file.fileno())
    tmp = temporary_path(target.parent, target.name)
    try:
        out_fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(out_fd, "wb") as out:
            shutil.copyfileobj(file, out, _BLOCK_BYTES)
            out.flush()
            os.fchmod(out_fd, stat.S_IMODE(status.st_mode))
            os.utime(out_fd, ns=(status.st_atime_ns, status.st_mtime_ns))
            os.fsync(out_fd)
        os.rename(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)


def _move_entry(entry: _Entry, folder: Path, name: str, *, copy: bool) -> Path:
    """Move what `entry` is, as itself, by name (a link stays a link), onto a claimed free name in `folder`;
    across file systems only a link is made anew (a FIFO or a socket cannot be copied)."""
    with _claim_free_name(folder, name) as target:
        try:
            entry.rename(target)
        except OSError as e:
            if e.errno != errno.EXDEV or not copy or not stat.S_ISLNK(entry.lstat().st_mode):
                raise
            target.unlink()  # a link is made only where nothing is in the way
            os.symlink(os.readlink(entry.name, dir_fd=entry.folder), target)
            entry.unlink()
    return target


@contextmanager
def _claim_free_name(folder: Path, name: str) -> Iterator[Path]:
    """A name in `folder` like `name` (`x.pdf`, `x (2).pdf`, …) that no other mover can take: created empty
    and exclusively (O_EXCL), so every other mover skips it, then replaced by the rename or copy that fills
    it. Checking that a name is free and renaming onto it is not enough: a rename replaces silently, and two
    movers would choose the same name. A move that fails gives the name back; a kill between the claim and
    the rename leaves an empty file under the name, the original untouched where it was.
    """
    stem, dot, suffix = name.rpartition(".") if "." in name.lstrip(".") else (name, "", "")
    number = 1
    while True:
        target = folder / (name if number == 1 else f"{stem} ({number}){dot}{suffix}")
        try:
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
            break
        except FileExistsError:
            number += 1
    try:
        yield target
    except BaseException:
        target.unlink(missing_ok=True)
        raise


def set_aside(source: Path, report: str, folders: Folders) -> Path | None:
    """Move a document that will not be processed into failed/, with `<name>.error.txt` beside it.

    Never by a copy: a document in an inbox on another file system (a USB disk, a network share) goes to
    its inbox's own hidden SET_ASIDE folder instead, by a rename. Copied, a refused file of any size (a
    sparse one made dense) would fill the home's disk and hold up the watcher, which sets files aside on its
    own thread. One that cannot be renamed there either (a file system mounted inside the inbox) stays where
    it is, and the log says why.
    """
    inbox = containing_inbox(source, folders.inboxes)
    if not os.path.lexists(source) or inbox is None:
        return None
    for folder in (folders.failed, inbox / SET_ASIDE):
        try:
            folder.mkdir(mode=0o700, exist_ok=True)
            moved = move_file(source, folder, source.name, copy=False)
            if moved is None:  # saved again while it was being moved: the new version is a new document
                return None
            write_file(moved.with_name(moved.name + ".error.txt"), report.encode(errors="replace"))
            return moved
        except OSError as e:
            if e.errno != errno.EXDEV:
                log.warning("could not move %s to %s: %s", source, folder, e)
                return None
    log.warning("left %s where it is: it is on another file system than %s and %s, and is not copied",
                source, folders.failed, inbox / SET_ASIDE)
    return None
