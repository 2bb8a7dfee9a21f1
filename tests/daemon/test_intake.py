"""Which paths become jobs, and the keys that make the same document under the same settings one job."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.postgres_server import PostgresServer

from npumoe.daemon.config import Config, ExtractConfig, ModelConfig, QueueConfig
from npumoe.daemon.intake import InboxIntake, enqueue, enqueue_paths, is_ignored, iter_documents, job_keys
from npumoe.jobs.files import Folders
from npumoe.jobs.queue.store import Job, Queue


@pytest.mark.parametrize("name", [".DS_Store", "._report.pdf", "~$draft.docx", "movie.part", "x.crdownload",
                                  "notes.tmp", ".Trashes/old.txt", "sub/.hidden/a.md"])
def test_hidden_temporary_and_partial_names_are_ignored(name: str) -> None:
    assert is_ignored(Path(name))


def test_ordinary_names_are_documents() -> None:
    assert not is_ignored(Path("Quarterly report (final).pdf"))


def test_a_folder_is_walked_only_one_level_when_not_recursive(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "sub" / "b.txt").write_text("b")
    assert list(iter_documents([tmp_path], recursive=False)) == [tmp_path / "a.txt"]
    assert list(iter_documents([tmp_path])) == [tmp_path / "a.txt", tmp_path / "sub" / "b.txt"]


def test_the_demo_model_key_does_not_depend_on_the_current_folder(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    before = job_keys(Config())
    (tmp_path / "demo").mkdir()
    monkeypatch.chdir(tmp_path)
    assert job_keys(Config()) == before == ("demo", before[1])


def test_settings_that_change_outputs_change_the_key() -> None:
    assert job_keys(Config())[1] != job_keys(Config(model=ModelConfig(overflow="prune")))[1]
    assert job_keys(Config())[1] == job_keys(Config(model=ModelConfig(idle_unload_seconds=5)))[1]


def test_the_keys_stay_those_of_the_outputs_already_written() -> None:
    """A new key would process every finished document again: these are the keys outboxes already hold."""
    assert job_keys(Config()) == ("demo", "e6a0785aa58e64d2")
    prompt = ModelConfig(pooling="prompt", overflow="prune", chunk_tokens=64)
    assert job_keys(Config(model=prompt)) == ("demo", "dc548cf2bdf6eb98")


class Settled:
    def __init__(self) -> None:
        self.calls: list[tuple[int, Path]] = []

    def __call__(self, job: Job, path: Path) -> None:
        self.calls.append((job.id, path))


def test_the_inbox_intake_queues_a_new_document_again_when_its_outputs_are_gone_and_sets_aside_what_is_no_document(
    tmp_path: Path
) -> None:
    inbox, outbox, processed, failed = (tmp_path / name for name in ("inbox", "outbox", "processed", "failed"))
    for folder in (inbox, outbox, processed, failed):
        folder.mkdir()
    queue, settled, woken = Queue(tmp_path / "q.db"), Settled(), []
    intake = InboxIntake(queue, Config(), Folders(outbox, processed, failed, (inbox.resolve(),)),
                         settle=settled, queued=lambda: woken.append(True))
    report = inbox / "report.md"
    report.write_text("a report")
    assert intake.take(report) and len(woken) == 1  # queued, and the idle worker woken
    [job] = queue.list()
    queue.claim(1, lease_seconds=60)
    queue.complete(job.id, 1, output_dir=str(outbox / "report"))
    # Done, but its outputs are not in the outbox (settled only against outputs there: test_following.py)
    assert intake.take(report) and len(woken) == 2 and settled.calls == []
    requeued = queue.get(job.id)
    assert requeued is not None and requeued.state == "queued"
    os.mkfifo(inbox / "pipe.md")
    assert intake.take(inbox / "pipe.md") and intake.rejected == 1
    assert "FIFO" in (failed / "pipe.md.error.txt").read_text()
    assert intake.take(inbox / "gone.md") and intake.rejected == 1  # vanished before it was queued: nothing to do


def test_a_file_over_the_size_limit_is_refused_before_it_is_read(tmp_path: Path) -> None:
    huge = tmp_path / "huge.txt"
    with huge.open("wb") as f:
        f.truncate(3 * 2**20)  # sparse: nothing to read, only a size
    with pytest.raises(ValueError, match="over the 2 MB limit"):
        enqueue(Queue(tmp_path / "q.db"), huge, Config(extract=ExtractConfig(max_mb=2)))


def test_enqueue_paths_queues_what_it_can_and_names_what_it_cannot(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("a")
    (docs / "big.txt").write_text("b" * 2**20)
    queue, config = Queue(tmp_path / "q.db"), Config(extract=ExtractConfig(max_mb=0.5))
    seen = []
    first = enqueue_paths(queue, [docs], config, on_job=lambda path, job, created: seen.append((path, created)))
    assert [(job.path, created) for job, created in first.jobs] == [(str(docs.resolve() / "a.txt"), True)]
    assert seen == [(docs / "a.txt", True)]
    assert len(first.problems) == 1 and first.problems[0].startswith(f"{docs / 'big.txt'}: ") and not first.failed
    again = enqueue_paths(queue, [docs / "a.txt", docs / "big.txt"], config)
    assert [created for _, created in again.jobs] == [False] and len(again.problems) == 1
    assert enqueue_paths(queue, [docs / "big.txt"], config).failed


def test_on_a_shared_queue_a_document_outside_the_shared_folders_is_pinned_to_the_machine_that_added_it(
    tmp_path: Path, postgres: PostgresServer
) -> None:
    shared, local = tmp_path / "shared", tmp_path / "local"
    for folder in (shared, local):
        folder.mkdir()
        (folder / "a.txt").write_text(f"a document in {folder.name}")
    queue = Queue(postgres.new_database(), host="laptop")
    config = Config(queue=QueueConfig(shared_folders=[str(shared)]))
    [(local_job, _), (shared_job, _)] = enqueue_paths(queue, [local, shared], config).jobs
    assert local_job.pinned_host == "laptop"  # no other machine can read the laptop's own files
    assert shared_job.pinned_host is None  # every machine sees the shared folder at this path
    queue.close()
