"""A done document's original, settled by policy only while it holds the content that was processed."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import pytest

from npumoe.jobs.errors import Failure
from npumoe.jobs.files import Folders, identify
from npumoe.jobs.originals import Originals
from npumoe.jobs.queue.store import Job, Queue

Make = Callable[[str], Originals]


@pytest.fixture
def originals(queue: Queue, inbox_folders: Folders) -> Make:
    return lambda policy: Originals(queue, inbox_folders, policy, max_bytes=2**20)


@pytest.fixture
def document(inbox_folders: Folders) -> Path:
    path = inbox_folders.inboxes[0] / "report.txt"
    path.write_text("The first version.\n")
    return path


@pytest.mark.parametrize(("policy", "in_inbox", "in_processed"),
                         [("keep", ["report.txt"], []), ("move", [], ["report.txt"]), ("delete", [], [])])
def test_an_unchanged_original_is_kept_moved_or_deleted_by_policy(
    originals: Make, queue: Queue, document: Path, claim: Callable[..., Job], inbox_folders: Folders, policy: str,
    in_inbox: list[str], in_processed: list[str]
) -> None:
    job = claim(queue, document)
    originals(policy).settle(job, document)
    assert [p.name for p in document.parent.iterdir()] == in_inbox
    assert [p.name for p in inbox_folders.processed.iterdir()] == in_processed


def test_an_original_saved_again_since_it_was_read_stays_and_its_new_content_is_queued(
    originals: Make, queue: Queue, document: Path, claim: Callable[..., Job]
) -> None:
    job = claim(queue, document)
    _, read = identify(document)
    document.write_text("A second version, saved after the first was read.\n")
    originals("delete").settle(job, document, read)
    assert document.exists()
    [new] = queue.list("queued")
    assert (new.path, new.sha256) == (job.path, hashlib.sha256(document.read_bytes()).hexdigest())


def test_an_original_gone_since_is_not_settled(
    originals: Make, queue: Queue, document: Path, claim: Callable[..., Job], inbox_folders: Folders
) -> None:
    job = claim(queue, document)
    document.unlink()
    originals("move").settle(job, document)
    assert list(inbox_folders.processed.iterdir()) == [] and queue.list("queued") == []


def test_changed_content_ends_the_job_naming_the_job_that_holds_it_now(
    originals: Make, queue: Queue, document: Path, claim: Callable[..., Job]
) -> None:
    job = claim(queue, document)
    with pytest.raises(Failure, match=r"its new content is queued as job #2$") as first:
        originals("keep").requeue_changed(job, "1" * 64)
    with pytest.raises(Failure, match=r"its new content is already job #2 \(queued\)$"):
        originals("keep").requeue_changed(job, "1" * 64)
    assert (first.value.kind, first.value.set_aside) == ("changed", False)
