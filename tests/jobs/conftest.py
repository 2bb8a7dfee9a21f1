"""What the tests of jobs/ share: a home's four folders, a queue that retries at once, a job claimed from it, and a
model whose engine is a stand-in (stand_in_engine.py)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from stand_in_engine import StandInModel

from npumoe.jobs.files import Folders
from npumoe.jobs.queue.store import Backoff, Job, Queue

Claim = Callable[..., Job]


@pytest.fixture
def stand_in_model() -> StandInModel:
    return StandInModel()


@pytest.fixture
def inbox_folders(tmp_path: Path) -> Folders:
    """inbox/, outbox/, processed/ and failed/ under tmp_path, the inbox the one originals are settled from."""
    for name in ("inbox", "outbox", "processed", "failed"):
        (tmp_path / name).mkdir()
    return Folders(tmp_path / "outbox", tmp_path / "processed", tmp_path / "failed", ((tmp_path / "inbox").resolve(),))


@pytest.fixture
def queue(tmp_path: Path) -> Iterator[Queue]:
    """A SQLite queue in tmp_path/queue.db whose failed jobs may run again at once."""
    queue = Queue(tmp_path / "queue.db", backoff=Backoff(base=0.0, cap=0.0))
    yield queue
    queue.close()


@pytest.fixture
def worker_pid() -> int:
    """The pid of the worker the tests claim jobs for."""
    return 4242


@pytest.fixture
def claim(worker_pid: int) -> Claim:
    """claim(queue, path, max_attempts=3): `path` queued by its content (model "m", settings "s") and claimed by
    `worker_pid`; a path that is no regular file is queued under a hash of zeros."""

    def claimed(queue: Queue, path: Path, max_attempts: int = 3) -> Job:
        regular = path.is_file() and not path.is_symlink()
        sha = hashlib.sha256(path.read_bytes()).hexdigest() if regular else "0" * 64
        queue.add(path, sha, model_key="m", settings_key="s", max_attempts=max_attempts)
        job = queue.claim(worker_pid, lease_seconds=60)
        assert job is not None
        return job

    return claimed
