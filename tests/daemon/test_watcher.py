"""The inbox watcher hands on each complete document once, and nothing that is not one."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from npumoe.daemon.config import InboxConfig
from npumoe.daemon.watcher import InboxWatcher, StabilityTracker


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Handed:
    """What the watcher handed on: each path with its size at that moment."""

    def __init__(self) -> None:
        self.calls: list[tuple[Path, int]] = []
        self.event = threading.Event()

    def __call__(self, path: Path) -> bool:
        self.calls.append((path, path.lstat().st_size))
        self.event.set()
        return True  # taken: the watcher marks it handed on

    @property
    def names(self) -> list[str]:
        return sorted(path.name for path, _ in self.calls)


@pytest.fixture
def inbox(tmp_path: Path) -> Path:
    folder = tmp_path / "inbox"
    folder.mkdir()
    return folder


@pytest.fixture
def running(inbox: Path) -> Iterator[Callable[..., Handed]]:
    """Start a background watcher on `inbox` with the given InboxConfig settings; stopped at the end."""
    watchers: list[InboxWatcher] = []

    def start(**settings: object) -> Handed:
        handed = Handed()
        config = InboxConfig(**{"stable_seconds": 0.4, "rescan_seconds": 60.0, **settings})  # type: ignore[arg-type]
        watchers.append(InboxWatcher([inbox], config, handed))
        watchers[-1].start()
        return handed

    yield start
    for watcher in watchers:
        watcher.stop()


# -- the stability rule, with a fake clock ---------------------------------------------------------------


def test_a_file_is_ready_once_unchanged_for_the_stable_delay(tmp_path: Path) -> None:
    clock = FakeClock()
    tracker = StabilityTracker(2.0, clock)
    doc = tmp_path / "a.txt"
    doc.write_text("hello")
    tracker.observe(doc)
    clock.now += 1.9
    assert tracker.take_stable() == []
    clock.now += 0.2
    assert tracker.take_stable() == [doc]
    assert tracker.waiting == 0


def test_a_change_restarts_the_wait(tmp_path: Path) -> None:
    clock = FakeClock()
    tracker = StabilityTracker(2.0, clock)
    doc = tmp_path / "a.txt"
    doc.write_text("hello")
    tracker.observe(doc)
    clock.now += 1.5
    with doc.open("a") as f:
        f.write(" world")
    assert tracker.take_stable() == []  # noticed the growth: waits from now
    clock.now += 1.5
    assert tracker.take_stable() == []
    clock.now += 0.6
    assert tracker.take_stable() == [doc]


def test_a_file_handed_on_is_not_handed_on_again_until_it_changes(tmp_path: Path) -> None:
    clock = FakeClock()
    tracker = StabilityTracker(0.0, clock)
    doc = tmp_path / "a.txt"
    doc.write_text("v1")
    tracker.observe(doc)
    assert tracker.take_stable() == [doc]
    tracker.observe(doc)  # a rescan, a late event
    assert tracker.take_stable() == []
    os.utime(doc, ns=(0, 123))
    tracker.observe(doc)
    assert tracker.take_stable() == [doc]


def test_a_file_that_disappears_while_waiting_is_dropped(tmp_path: Path) -> None:
    clock = FakeClock()
    tracker = StabilityTracker(1.0, clock)
    doc = tmp_path / "a.txt"
    doc.write_text("bye")
    tracker.observe(doc)
    doc.unlink()
    clock.now += 5
    assert tracker.take_stable() == [] and tracker.waiting == 0


# -- the watcher on real folders ---------------------------------------------------------------------------


def test_a_file_written_slowly_in_pieces_is_handed_on_once_after_it_is_complete(
    inbox: Path, running: Callable[..., Handed]
) -> None:
    handed = running(stable_seconds=0.6)
    doc = inbox / "slow.txt"
    piece = b"x" * 1000
    with doc.open("wb") as f:
        for _ in range(8):  # 8 pieces, 0.25 s apart: never still for the 0.6 s it takes
            f.write(piece)
            f.flush()
            time.sleep(0.25)
    assert handed.event.wait(10)
    time.sleep(1.5)  # time enough for a second, wrong hand-on
    assert handed.calls == [(doc, 8000)]


def test_files_already_there_at_start_are_found(inbox: Path) -> None:
    (inbox / "sub").mkdir()
    (inbox / "a.md").write_text("a")
    (inbox / "sub" / "b.txt").write_text("b")
    handed = Handed()
    watcher = InboxWatcher([inbox], InboxConfig(stable_seconds=0.1), handed)
    watcher.drain(threading.Event())
    assert handed.names == ["a.md", "b.txt"]


def test_nested_folders_are_skipped_when_not_recursive(inbox: Path) -> None:
    (inbox / "sub").mkdir()
    (inbox / "a.md").write_text("a")
    (inbox / "sub" / "b.txt").write_text("b")
    handed = Handed()
    InboxWatcher([inbox], InboxConfig(stable_seconds=0.1, recursive=False), handed).drain(threading.Event())
    assert handed.names == ["a.md"]


@pytest.mark.parametrize(
    "name",
    [
        ".DS_Store",
        "._report.pdf",
        "~$report.docx",
        "report.pdf.part",
        "movie.crdownload",
        "draft.tmp",
        ".Trashes/old.txt",
        "notes.txt~",
        ".hidden/inner.md",
    ],
)
def test_hidden_temporary_and_partial_files_are_ignored(inbox: Path, name: str) -> None:
    path = inbox / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("not a document")
    (inbox / "real.txt").write_text("a document")
    handed = Handed()
    InboxWatcher([inbox], InboxConfig(stable_seconds=0.0), handed).drain(threading.Event())
    assert handed.names == ["real.txt"]


def test_a_symlinked_folder_is_not_entered(inbox: Path, tmp_path: Path) -> None:
    outside = tmp_path / "private"
    outside.mkdir()
    (outside / "secret.txt").write_text("not for the daemon")
    (inbox / "link").symlink_to(outside, target_is_directory=True)
    handed = Handed()
    watcher = InboxWatcher([inbox], InboxConfig(stable_seconds=0.0), handed)
    watcher.drain(threading.Event())
    watcher.observe(inbox / "link" / "secret.txt")  # as an event naming a path through the link would
    watcher.hand_on_stable()
    assert handed.calls == []


def test_a_file_added_while_running_is_noticed_by_its_events(
    inbox: Path, running: Callable[..., Handed], wait_for: Callable[..., bool]
) -> None:
    handed = running()
    time.sleep(0.3)  # the first scan is done
    (inbox / "new.md").write_text("fresh")
    assert wait_for(lambda: handed.names == ["new.md"])


def test_a_file_moved_into_the_inbox_counts(
    inbox: Path, tmp_path: Path, running: Callable[..., Handed], wait_for: Callable[..., bool]
) -> None:
    staged = tmp_path / "download.pdf"
    staged.write_bytes(b"%PDF-1.4 pretend")
    handed = running()
    time.sleep(0.3)
    staged.rename(inbox / "download.pdf")
    assert wait_for(lambda: handed.names == ["download.pdf"])


def test_a_folder_moved_in_whole_is_looked_through(
    inbox: Path, tmp_path: Path, running: Callable[..., Handed], wait_for: Callable[..., bool]
) -> None:
    folder = tmp_path / "batch"
    folder.mkdir()
    (folder / "one.txt").write_text("1")
    (folder / "two.txt").write_text("2")
    handed = running()
    time.sleep(0.3)
    folder.rename(inbox / "batch")
    assert wait_for(lambda: handed.names == ["one.txt", "two.txt"])


def test_the_polling_observer_notices_new_files(
    inbox: Path, running: Callable[..., Handed], wait_for: Callable[..., bool]
) -> None:
    handed = running(polling=True)
    time.sleep(0.3)
    (inbox / "on-a-share.txt").write_text("no inotify here")
    assert wait_for(lambda: handed.names == ["on-a-share.txt"])


def test_the_periodic_rescan_finds_what_no_event_reported(inbox: Path, wait_for: Callable[..., bool]) -> None:
    handed = Handed()
    watcher = InboxWatcher([inbox], InboxConfig(stable_seconds=0.1, rescan_seconds=0.3), handed)
    watcher.start()
    try:
        assert watcher._observer is not None
        watcher._observer.unschedule_all()  # no events at all from here on
        (inbox / "quiet.txt").write_text("arrived without an event")
        assert wait_for(lambda: handed.names == ["quiet.txt"])
    finally:
        watcher.stop()


def test_run_once_does_not_wait_forever_for_a_file_that_keeps_changing(inbox: Path) -> None:
    (inbox / "done.txt").write_text("complete")
    growing = inbox / "app.log"
    growing.write_text("first line\n")
    stop = threading.Event()

    def append_forever() -> None:
        with growing.open("a") as f:
            while not stop.is_set():
                f.write("another line\n")
                f.flush()
                time.sleep(0.05)

    writer = threading.Thread(target=append_forever)
    writer.start()
    try:
        handed = Handed()
        left = InboxWatcher([inbox], InboxConfig(stable_seconds=0.3), handed).drain(threading.Event(), patience=1.5)
    finally:
        stop.set()
        writer.join()
    assert handed.names == ["done.txt"] and left == 1


def test_a_file_not_taken_is_offered_again_at_the_next_scan(inbox: Path) -> None:
    doc = inbox / "a.txt"
    doc.write_text("queued once the queue can take it")
    offered: list[Path] = []
    answers = iter([False, True])  # the first time, queueing failed (a busy database, an I/O error)

    def take(path: Path) -> bool:
        offered.append(path)
        return next(answers)

    watcher = InboxWatcher([inbox], InboxConfig(stable_seconds=0.0), take)
    watcher.drain(threading.Event())
    watcher.drain(threading.Event())  # the next rescan
    watcher.drain(threading.Event())  # and one after it: taken by now, so not offered again
    assert offered == [doc, doc]
