"""Output files appear complete or not at all, under safe names, readable by the user only."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from npumoe.jobs import outputs
from npumoe.jobs.outputs import output_name, remove_leftovers, safe_stem, write_file, write_folder

SHA = "0123456789abcdef" * 4


FILES = {"summary.md": b"# done\n", "embeddings.npy": os.urandom(4 << 20), "meta.json": b'{"complete": true}'}


def watch_outbox(outbox: Path, look: Callable[[Path], None]) -> Callable[[], int]:
    """Call `look(folder)` on every visible output folder, over and over, until the returned stop() is called."""
    stop, looks = threading.Event(), 0

    def reader() -> None:
        nonlocal looks
        while not stop.is_set():
            for folder in outbox.glob("doc-*"):
                looks += 1
                look(folder)

    thread = threading.Thread(target=reader)
    thread.start()

    def finish() -> int:
        stop.set()
        thread.join()
        return looks

    return finish


def test_a_new_output_folder_appears_with_every_file_complete(tmp_path: Path) -> None:
    incomplete = []

    def look(folder: Path) -> None:
        found = {p.name: p.read_bytes() for p in folder.iterdir()}
        if found != FILES:
            incomplete.append(sorted((name, len(data)) for name, data in found.items()))

    finish = watch_outbox(tmp_path, look)
    try:
        for i in range(12):
            write_folder(tmp_path, f"doc-{i}", FILES)
    finally:
        looks = finish()
    assert looks > 0
    assert incomplete == []


def test_a_replaced_output_folder_never_shows_a_partial_file(tmp_path: Path) -> None:
    partial = []

    def look(folder: Path) -> None:
        for name, data in FILES.items():
            try:
                content = (folder / name).read_bytes()
            except FileNotFoundError:  # the old folder being removed: absent is fine, half is not
                continue
            if content != data:
                partial.append((name, len(content)))

    finish = watch_outbox(tmp_path, look)
    try:
        for _ in range(12):
            write_folder(tmp_path, "doc-0", FILES)
    finally:
        looks = finish()
    assert looks > 0
    assert partial == []


def test_a_writer_that_fails_midway_leaves_no_folder_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = 0
    real_fsync = os.fsync

    def failing_fsync(fd: int) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise OSError(28, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(outputs.os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="No space"):
        write_folder(tmp_path, "doc", {"a.txt": b"a", "b.txt": b"b", "c.txt": b"c"})
    assert list(tmp_path.iterdir()) == []


def test_leftovers_of_a_killed_writer_are_removed_and_nothing_else(tmp_path: Path) -> None:
    (tmp_path / ".tmp-doc-1234abcd").mkdir()
    (tmp_path / ".tmp-doc-1234abcd" / "meta.json").write_text("{")
    (tmp_path / ".tmp-note.txt-99").write_text("half")
    (tmp_path / "doc-1").mkdir()
    (tmp_path / "keep.txt").write_text("mine")
    removed = remove_leftovers(tmp_path)
    assert sorted(p.name for p in removed) == [".tmp-doc-1234abcd", ".tmp-note.txt-99"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc-1", "keep.txt"]


def test_writing_a_folder_again_replaces_it_whole(tmp_path: Path) -> None:
    write_folder(tmp_path, "doc", {"old.txt": b"old", "meta.json": b"1"})
    final = write_folder(tmp_path, "doc", {"meta.json": b"2"})
    assert {p.name: p.read_bytes() for p in final.iterdir()} == {"meta.json": b"2"}
    assert [p.name for p in tmp_path.iterdir()] == ["doc"]


def test_outputs_are_readable_by_the_user_only(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        folder = write_folder(tmp_path, "doc", {"meta.json": b"{}"})
        single = write_file(tmp_path / "note.txt", b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE((folder / "meta.json").stat().st_mode) == 0o600
    assert stat.S_IMODE(single.stat().st_mode) == 0o600


@pytest.mark.parametrize(
    ("name", "stem"),
    [
        ("report.pdf", "report"),
        ("Quarterly report v2.final.docx", "Quarterly_report_v2.final"),
        ("../../etc/passwd", "passwd"),
        ("..", "document"),
        (".hidden.txt", "hidden"),
        ("line\nbreak.txt", "line_break"),
        ("tab\there\r.md", "tab_here"),
        ("résumé 日本語.txt", "résumé_日本語"),
        ("", "document"),
        ("x" * 300 + ".txt", "x" * 80),
    ],
)
def test_output_names_are_one_safe_path_component(name: str, stem: str) -> None:
    assert safe_stem(name) == stem
    folder = output_name(name, SHA, "model", "settings")
    assert folder.startswith(f"{stem}-") and len(folder) == len(stem) + 17
    assert "/" not in folder and "\n" not in folder and not folder.startswith(".")


def test_an_output_name_tells_apart_documents_models_and_settings_in_64_bits() -> None:
    names = {output_name("report.pdf", sha, model, settings)
             for sha in (SHA, SHA[:8] + "f" * 56) for model in ("small", "large") for settings in ("s1", "s2")}
    assert len(names) == 8  # the same first 8 hex digits of content no longer share a folder either
    assert all(len(name.removeprefix("report-")) == 16 for name in names)


@pytest.mark.parametrize(("killed_at", "survivor"), [("rename", b"old"), ("rmtree", b"new")])
def test_a_replace_killed_half_way_keeps_the_old_outputs_or_the_new_never_neither(
    tmp_path: Path, killed_at: str, survivor: bytes
) -> None:
    write_folder(tmp_path, "doc", {"meta.json": b"old"})
    # A writer killed (no clean-up of its own) at the second rename, or while removing the old folder.
    code = textwrap.dedent(f"""
        import os, shutil
        from pathlib import Path
        from npumoe.jobs.outputs import write_folder
        real, renames = os.rename, []
        def rename(source, target):
            renames.append(source)
            if {killed_at!r} == "rename" and len(renames) == 2:
                os._exit(9)
            real(source, target)
        os.rename = rename
        shutil.rmtree = lambda path, **kwargs: os._exit(9)
        write_folder(Path({str(tmp_path)!r}), "doc", {{"meta.json": b"new"}})
    """)
    assert subprocess.run([sys.executable, "-c", code]).returncode == 9

    remove_leftovers(tmp_path)  # what the next start does

    assert [p.name for p in tmp_path.iterdir()] == ["doc"]
    assert (tmp_path / "doc" / "meta.json").read_bytes() == survivor
