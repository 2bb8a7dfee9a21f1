"""Which paths become jobs, and the keys that make the same document under the same settings one job."""

from __future__ import annotations

from pathlib import Path

import pytest
from postgres_server import PostgresServer

from npumoe.daemon.config import Config, ExtractConfig, ModelConfig, QueueConfig
from npumoe.daemon.intake import enqueue, enqueue_paths, is_ignored, iter_documents, job_keys
from npumoe.jobs.queue.store import Queue


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
