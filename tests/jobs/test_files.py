"""The one safe open every reader of a document uses: what it refuses, and the words it gives."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from npumoe.jobs.errors import FileRefused
from npumoe.jobs.extract.isolated import ExtractLimits, extract_text
from npumoe.jobs.files import (
    CHANGED,
    DELETE,
    MOVE,
    SET_ASIDE,
    Folders,
    Version,
    identify,
    move_file,
    open_regular,
    set_aside,
    settle_original,
    snapshot,
)

F_GETPATH = 50  # macOS: the path of an open descriptor


def refusal(path: Path, max_bytes: int | None = None) -> FileRefused:
    with pytest.raises(FileRefused) as caught:
        open_regular(path, max_bytes)
    return caught.value


def renamed_from(src: object, src_dir_fd: int | None = None) -> Path:
    """The path a rename takes its file from: given whole, or (how an original is moved) as a name in a folder
    held open by a descriptor."""
    if src_dir_fd is None:
        return Path(os.fsdecode(src))  # type: ignore[arg-type]
    if sys.platform == "darwin":
        folder = fcntl.fcntl(src_dir_fd, F_GETPATH, bytes(1024)).rstrip(b"\0").decode()
    else:
        folder = os.readlink(f"/proc/self/fd/{src_dir_fd}")
    return Path(folder) / os.fsdecode(src)  # type: ignore[arg-type]


def test_a_regular_file_within_the_limit_opens(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"hello")
    with open_regular(tmp_path / "a.txt", 5) as file:
        assert file.read() == b"hello"


def test_what_is_not_a_regular_file_is_refused_by_its_kind(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "link.txt").symlink_to(tmp_path / "a.txt")
    (tmp_path / "loop.txt").symlink_to(tmp_path / "loop.txt")
    os.mkfifo(tmp_path / "pipe.txt")
    (tmp_path / "folder").mkdir()
    expected = {"link.txt": "a symbolic link", "loop.txt": "a symbolic link", "pipe.txt": "a FIFO",
                "folder": "a folder"}
    for name, kind in expected.items():
        refused = refusal(tmp_path / name)
        assert (refused.kind, str(refused)) == ("unreadable", f"the file is {kind}, not a regular file")
    assert refusal(tmp_path / "gone.txt").kind == "missing"


def test_a_file_over_the_limit_is_refused_in_the_units_of_the_setting(tmp_path: Path) -> None:
    huge = tmp_path / "huge.txt"
    with huge.open("wb") as f:
        f.truncate(2**20)  # sparse: nothing to read, only a size
    refused = refusal(huge, 2**19)
    assert refused.kind == "too_large" and "1,048,576 bytes, over the 0.5 MB limit" in str(refused)


def test_every_reader_refuses_a_file_with_the_same_kind_and_the_same_words(tmp_path: Path) -> None:
    huge = tmp_path / "huge.txt"
    huge.write_bytes(b"x" * 2**20)
    readers = (lambda: identify(huge, 2**19),  # intake hashing it
               lambda: snapshot(huge, tmp_path / "copy", 2**19),  # the pipeline copying it
               lambda: extract_text(huge, ExtractLimits(max_bytes=2**19)))  # extraction parsing it
    refusals = [(refused.kind, str(refused)) for refused in map(refusal_of, readers)]
    assert refusals == [("too_large", "the file is 1,048,576 bytes, over the 0.5 MB limit (extract.max_mb)")] * 3


def test_an_empty_file_is_refused_only_where_text_is_needed(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").touch()
    with open_regular(tmp_path / "empty.txt") as file:  # intake may queue it: the job records why it has no text
        assert file.read() == b""
    refused = refusal_of(lambda: open_regular(tmp_path / "empty.txt", empty=False))
    assert (refused.kind, str(refused)) == ("empty", "file is empty (0 bytes)")


def refusal_of(read: Callable[[], object]) -> FileRefused:
    with pytest.raises(FileRefused) as caught:
        read()
    return caught.value


def test_a_snapshot_is_a_private_copy_with_its_hash(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"hello")
    sha256, identity = snapshot(tmp_path / "a.txt", tmp_path / "copy", 5)
    assert sha256 == "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
    assert identity == Version.at(tmp_path / "a.txt")  # the file it read: what settling the original checks
    assert (tmp_path / "copy").read_bytes() == b"hello" and (tmp_path / "copy").stat().st_mode & 0o777 == 0o600


def test_the_jobs_errors_import_neither_numpy_nor_torch() -> None:
    code = "import sys, npumoe.jobs.errors; print(sorted({'numpy', 'torch'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


def rewrite_in_place(path: Path, data: bytes) -> None:
    """What an editor saving in place does, then putting the old mtime back (rsync -t, a sync tool): the same
    inode, the same size and mtime; only the ctime moves (waited for, on a clock of coarse ticks)."""
    before = os.stat(path)
    with path.open("r+b") as file:
        file.write(data)
    while True:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        if os.stat(path).st_ctime_ns != before.st_ctime_ns:
            return


def save_atomically(path: Path, data: bytes) -> None:
    """What most editors do: write a new file beside it and rename it over the old one."""
    (path.parent / ".saving").write_bytes(data)
    os.replace(path.parent / ".saving", path)


def test_a_rewrite_that_keeps_size_and_mtime_is_not_the_file_that_was_read(inbox_folders: Folders,
                                                                           tmp_path: Path) -> None:
    source = tmp_path / "inbox" / "a.txt"
    source.write_bytes(b"first")
    _, read = identify(source)
    rewrite_in_place(source, b"later")

    assert settle_original(source, MOVE, inbox_folders, read) == CHANGED
    assert source.read_bytes() == b"later" and list(inbox_folders.processed.iterdir()) == []


@pytest.mark.parametrize("save", [rewrite_in_place, save_atomically])
def test_a_save_while_moving_across_file_systems_keeps_the_new_version(
    inbox_folders: Folders, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, save: Callable[[Path, bytes], None]
) -> None:
    source = tmp_path / "inbox" / "a.txt"
    source.write_bytes(b"first")
    _, read = identify(source)
    real_rename = os.rename

    def cross_device_with_a_save(src: object, dst: object, **kwargs: int) -> None:
        if renamed_from(src, **kwargs) == source:  # the inbox on another file system, and the person saving meanwhile
            save(source, b"later")
            raise OSError(18, "Invalid cross-device link")
        real_rename(src, dst, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "rename", cross_device_with_a_save)
    assert settle_original(source, MOVE, inbox_folders, read) == CHANGED
    assert source.read_bytes() == b"later"
    assert list(inbox_folders.processed.iterdir()) == []  # the copy is taken back, temporary and all


def test_moving_never_overwrites_a_file_already_there(tmp_path: Path) -> None:
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "a.txt").write_text("earlier")
    first = tmp_path / "a.txt"
    first.write_text("later")
    moved = move_file(first, tmp_path / "done", "a.txt")
    assert moved.name == "a (2).txt" and moved.read_text() == "later"
    assert (tmp_path / "done" / "a.txt").read_text() == "earlier"
    assert not first.exists()


def test_moving_across_file_systems_copies_then_removes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_cross_device_rename(src: object, dst: object, **kwargs: int) -> None:
        if renamed_from(src, **kwargs).parent == tmp_path:
            raise OSError(18, "Invalid cross-device link")
        os.replace(src, dst, **kwargs)  # type: ignore[arg-type]

    (tmp_path / "done").mkdir()
    source = tmp_path / "a.txt"
    source.write_text("content")
    monkeypatch.setattr(os, "rename", no_cross_device_rename)
    moved = move_file(source, tmp_path / "done", "a.txt")
    assert moved.read_text() == "content" and not source.exists()
    assert [p.name for p in (tmp_path / "done").iterdir()] == ["a.txt"]  # no temporary left behind


def test_a_folder_swapped_for_a_link_after_queueing_is_refused(tmp_path: Path) -> None:
    (tmp_path / "inbox" / "reports").mkdir(parents=True)
    (tmp_path / "inbox" / "reports" / "a.txt").write_text("queued")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "a.txt").write_text("private")
    queued = tmp_path / "inbox" / "reports" / "a.txt"  # as recorded: its folder resolved, so no link in it
    (tmp_path / "inbox" / "reports").rename(tmp_path / "inbox" / "moved")
    (tmp_path / "inbox" / "reports").symlink_to(tmp_path / "elsewhere")

    refused = refusal_of(lambda: snapshot(queued, tmp_path / "copy", 100))
    assert (refused.kind, str(refused)) == ("unreadable", "a folder on its path is a symbolic link, not a folder")
    assert not (tmp_path / "copy").exists()


def test_a_file_with_another_hard_link_is_refused(tmp_path: Path) -> None:
    (tmp_path / "secret.txt").write_text("elsewhere")
    os.link(tmp_path / "secret.txt", tmp_path / "a.txt")  # a name in the inbox for a file kept somewhere else

    refused = refusal(tmp_path / "a.txt")
    assert refused.kind == "unreadable"
    assert str(refused) == "the file has 2 hard links; only a file with a single name is read"


def test_a_file_whose_every_open_fails_with_an_io_error_is_set_aside_all_the_same(
        inbox_folders: Folders, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad sector: the file cannot be opened, so it cannot be copied, but it can still be renamed into failed/."""
    source = tmp_path / "inbox" / "bad.txt"
    source.write_bytes(b"unreadable now")
    opened: list[str] = []

    def failing_open(path: object, *args: object, **kwargs: object) -> int:
        if os.fsdecode(path) in ("bad.txt", str(source)):  # type: ignore[arg-type]  # by name in its folder, or whole
            opened.append(os.fsdecode(path))  # type: ignore[arg-type]
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

    real_open = os.open
    monkeypatch.setattr(os, "open", failing_open)
    moved = set_aside(source, "kind: machine, I/O error", inbox_folders)
    assert opened  # the move tried to read it first
    assert moved == inbox_folders.failed / "bad.txt" and not source.exists()
    assert (inbox_folders.failed / "bad.txt.error.txt").read_text() == "kind: machine, I/O error"



@pytest.mark.parametrize("across_file_systems", [False, True], ids=["same file system", "across file systems"])
def test_two_same_named_files_moved_at_once_both_survive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         across_file_systems: bool) -> None:
    """The worker and the watcher each set aside an `x.pdf` from different folders at the same moment: both
    movers choose their names before either one lands, so a name that is only checked, not claimed, is taken
    twice and the second file replaces the first."""
    (tmp_path / "failed").mkdir()
    sources = []
    for folder, content in (("a", "small and corrupt"), ("b", "large")):
        (tmp_path / folder).mkdir()
        sources.append(tmp_path / folder / "x.pdf")
        sources[-1].write_text(content)
    both_chose = threading.Barrier(2, timeout=10)
    real_rename = os.rename
    landed: list[str] = []

    def rename_once_both_have_chosen(src: object, dst: object, **kwargs: int) -> None:
        if renamed_from(src, **kwargs) in sources:
            both_chose.wait()  # each mover has picked its destination by now
            landed.append(os.fsdecode(src))  # type: ignore[arg-type]
            if across_file_systems:
                raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
        real_rename(src, dst, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "rename", rename_once_both_have_chosen)
    moved: list[Path | None] = [None, None]

    def mover(index: int) -> None:
        moved[index] = move_file(sources[index], tmp_path / "failed", "x.pdf")

    threads = [threading.Thread(target=mover, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(landed) == 2  # both moves went through the forced race
    assert sorted(p.read_text() for p in (tmp_path / "failed").iterdir()) == ["large", "small and corrupt"]
    assert sorted(p.name for p in (tmp_path / "failed").iterdir()) == ["x (2).pdf", "x.pdf"]
    assert {moved[0], moved[1]} == {tmp_path / "failed" / "x.pdf", tmp_path / "failed" / "x (2).pdf"}
    assert not any(source.exists() for source in sources)


def no_rename_across(boundary: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Renames from inside `boundary` to outside it fail as they do between two file systems."""
    real_rename = os.rename

    def rename(src: object, dst: object, **kwargs: int) -> None:
        inside = [p.is_relative_to(boundary) for p in (renamed_from(src, **kwargs), renamed_from(dst))]
        if inside[0] != inside[1]:
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
        real_rename(src, dst, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "rename", rename)


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every copy of a file's bytes shutil is asked to make."""
    made: list[str] = []
    real_copyfileobj = shutil.copyfileobj

    def copyfileobj(source: object, target: object, *args: object) -> None:
        made.append(str(getattr(source, "name", source)))
        real_copyfileobj(source, target, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(shutil, "copyfileobj", copyfileobj)
    return made


def test_a_file_in_an_inbox_on_another_file_system_is_set_aside_there_never_copied(
        inbox_folders: Folders, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, copies: list[str]) -> None:
    """A sparse 1 TB file copied into failed/ would fill the home's disk, on the watcher's thread."""
    huge = tmp_path / "inbox" / "reports" / "huge.pdf"
    huge.parent.mkdir()
    with huge.open("wb") as file:
        file.truncate(2**26)  # sparse: a size, no blocks
    no_rename_across(tmp_path / "inbox", monkeypatch)

    moved = set_aside(huge, "not queued: the file is 67,108,864 bytes, over the 1 MB limit\n", inbox_folders)
    assert copies == []
    assert list(inbox_folders.failed.iterdir()) == []
    assert moved == tmp_path / "inbox" / SET_ASIDE / "huge.pdf" and moved.stat().st_size == 2**26
    assert not huge.exists()
    assert Path(f"{moved}.error.txt").read_text().startswith("not queued: the file is 67,108,864 bytes")


def test_a_file_that_cannot_leave_its_file_system_without_a_copy_stays_where_it_is(
        inbox_folders: Folders, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, copies: list[str]) -> None:
    """A folder mounted inside an inbox: neither failed/ nor the inbox's set-aside folder is on its file system."""
    huge = tmp_path / "inbox" / "mounted" / "huge.pdf"
    huge.parent.mkdir()
    huge.write_bytes(b"%PDF-1.7 and much more")
    no_rename_across(huge.parent, monkeypatch)

    assert set_aside(huge, "not queued: too large\n", inbox_folders) is None
    assert copies == [] and huge.read_bytes() == b"%PDF-1.7 and much more"
    assert list(inbox_folders.failed.iterdir()) == list((tmp_path / "inbox" / SET_ASIDE).iterdir()) == []


@pytest.mark.parametrize("originals", [MOVE, DELETE])
def test_a_folder_swapped_for_a_link_after_the_check_redirects_no_move_and_no_delete(
        inbox_folders: Folders, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, originals: str) -> None:
    """In an inbox others can write to, the folder holding a finished document is swapped for a link to a
    folder with a file of the same name, between the look at the document and the act on it."""
    reports = tmp_path / "inbox" / "reports"
    reports.mkdir()
    source = reports / "a.txt"
    source.write_text("processed")
    _, read = identify(source)
    (tmp_path / "private").mkdir()
    (tmp_path / "private" / "a.txt").write_text("someone's own")
    real_lstat, real_stat = os.lstat, os.stat
    looks = []

    def swap_after_the_look(real: Callable[..., os.stat_result], path: object, *args: object,
                            **kwargs: object) -> os.stat_result:
        looked = real(path, *args, **kwargs)
        if os.fsdecode(path) in ("a.txt", str(source)) and looked.st_ino == read.inode:  # type: ignore[arg-type]
            looks.append(path)
            if len(looks) == 2 and not reports.is_symlink():  # the check before the act (the first: settling)
                reports.rename(tmp_path / "inbox" / "moved-away")
                reports.symlink_to(tmp_path / "private")
        return looked

    monkeypatch.setattr(os, "lstat", lambda path, *a, **k: swap_after_the_look(real_lstat, path, *a, **k))
    monkeypatch.setattr(os, "stat", lambda path, *a, **k: swap_after_the_look(real_stat, path, *a, **k))
    settled = settle_original(source, originals, inbox_folders, read)
    monkeypatch.undo()
    assert reports.is_symlink()  # the swap happened while it settled
    assert (tmp_path / "private" / "a.txt").read_text() == "someone's own"
    assert settled == ("deleted" if originals == DELETE else f"moved to {inbox_folders.processed / 'a.txt'}")
    assert not (tmp_path / "inbox" / "moved-away" / "a.txt").exists()
    if originals == MOVE:
        assert (inbox_folders.processed / "a.txt").read_text() == "processed"
