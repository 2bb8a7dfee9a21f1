"""The one safe open every reader of a document uses: what it refuses, and the words it gives."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from npumoe.jobs.errors import FileRefused
from npumoe.jobs.extract.isolated import ExtractLimits, extract_text
from npumoe.jobs.files import Identity, identify, open_regular, snapshot


def refusal(path: Path, max_bytes: int | None = None) -> FileRefused:
    with pytest.raises(FileRefused) as caught:
        open_regular(path, max_bytes)
    return caught.value


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
    assert identity == Identity.at(tmp_path / "a.txt")  # the file it read: what settling the original checks
    assert (tmp_path / "copy").read_bytes() == b"hello" and (tmp_path / "copy").stat().st_mode & 0o777 == 0o600


def test_the_jobs_errors_import_neither_numpy_nor_torch() -> None:
    code = "import sys, npumoe.jobs.errors; print(sorted({'numpy', 'torch'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"
