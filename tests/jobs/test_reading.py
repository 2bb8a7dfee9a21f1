"""Reading a queued document: a private copy with its hash, then its text; what stops either is the document's
Failure, or the machine's fault."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

import pytest

from npumoe.jobs import reading
from npumoe.jobs.errors import ExtractionError, Failure, Stop
from npumoe.jobs.extract.isolated import ExtractLimits
from npumoe.jobs.faults import MachineFault
from npumoe.jobs.reading import copy_document, extract

LIMITS = ExtractLimits(timeout_s=20, memory_mb=512, max_bytes=2**20)


@pytest.fixture
def work(tmp_path: Path) -> Path:
    folder = tmp_path / "outbox" / ".tmp-job1"
    folder.mkdir(parents=True)
    return folder


def test_the_copy_is_private_hashed_and_keeps_a_plain_extension(tmp_path: Path, work: Path) -> None:
    source = tmp_path / "notes.m d;"
    source.write_bytes(b"# Notes\n")
    copy, sha256, _ = copy_document(source, work, LIMITS.max_bytes)
    assert (copy, copy.read_bytes()) == (work / "document.md", b"# Notes\n")
    assert sha256 == hashlib.sha256(b"# Notes\n").hexdigest()


def test_a_document_gone_before_it_was_copied_fails_and_is_no_ones_to_set_aside(tmp_path: Path, work: Path) -> None:
    with pytest.raises(Failure) as failure:
        copy_document(tmp_path / "gone.txt", work, LIMITS.max_bytes)
    assert (failure.value.kind, failure.value.retryable, failure.value.set_aside) == ("missing", False, False)


@pytest.mark.parametrize(("code", "blamed"), [(errno.EIO, "inbox"), (errno.ENOSPC, "outbox")])
def test_an_io_error_is_the_inboxs_fault_and_a_full_disk_the_work_folders(
    tmp_path: Path, work: Path, monkeypatch: pytest.MonkeyPatch, code: int, blamed: str
) -> None:
    def failing(*_: object) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(reading, "snapshot", failing)
    (tmp_path / "inbox").mkdir()
    with pytest.raises(MachineFault) as fault:
        copy_document(tmp_path / "inbox" / "a.txt", work, LIMITS.max_bytes)
    assert (fault.value.code, fault.value.folder) == (code, tmp_path / blamed)


@pytest.mark.parametrize(("kind", "retryable"), [("timeout", True), ("memory", True), ("corrupt", False)])
def test_an_extraction_is_retried_only_when_the_machine_was_busy_or_short_of_memory(
    work: Path, monkeypatch: pytest.MonkeyPatch, kind: str, retryable: bool
) -> None:
    def failing(*_: object) -> None:
        raise ExtractionError(kind, "it did not go well")

    monkeypatch.setattr(reading, "extract_text", failing)
    with pytest.raises(Failure) as failure:
        extract(work / "document.txt", LIMITS, check=lambda: None)
    assert (failure.value.kind, failure.value.retryable, failure.value.set_aside) == (kind, retryable, True)


def test_an_extractor_that_died_of_the_workers_stop_hands_the_job_back_not_fails_it(
    work: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checks = []

    def killed(*_: object) -> None:
        raise ExtractionError("corrupt", "the parser crashed (killed by SIGINT)")

    def stopping() -> None:
        checks.append(1)
        raise Stop

    monkeypatch.setattr(reading, "extract_text", killed)
    with pytest.raises(Stop):
        extract(work / "document.txt", LIMITS, check=stopping)
    assert checks == [1]


def test_a_documents_text_is_extracted_from_the_copy(tmp_path: Path, work: Path) -> None:
    source = tmp_path / "a.txt"
    source.write_text("Plain words.\n")
    copy, _, _ = copy_document(source, work, LIMITS.max_bytes)
    source.write_text("Changed after the copy.\n")
    assert extract(copy, LIMITS, check=lambda: None).text == "Plain words."
