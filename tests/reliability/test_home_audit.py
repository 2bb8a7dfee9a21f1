"""The audit the crash and load tests rely on: it must see each way a document can be lost or duplicated."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
from home_audit import audit

from npumoe.jobs.outputs import OFFSETS_FILE, TEXT_FILE, output_name, temporary_path, write_folder
from npumoe.jobs.queue.store import Queue

PID = 4242


def npy(rows: int) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.zeros((rows, 4), dtype=np.float32))
    return buffer.getvalue()


class FakeHome:
    """A home as a daemon would leave it, built through the queue and the atomic writers."""

    def __init__(self, root: Path) -> None:
        self.root = root
        for folder in ("inbox", "outbox", "processed", "failed"):
            (root / folder).mkdir(parents=True)
        self.queue = Queue(root / "npumoed.db")
        self.dropped: dict[str, str] = {}

    def finish(self, name: str, text: str, settings: str = "s") -> str:
        """A document processed the way the daemon does it: done job, output folder, original moved."""
        data = text.encode()
        sha = hashlib.sha256(data).hexdigest()
        (self.root / "processed" / name).write_bytes(data)
        job, _ = self.queue.add(self.root / "inbox" / name, sha, model_key="m", settings_key=settings)
        claimed = self.queue.claim(PID, lease_seconds=60)
        assert claimed is not None and claimed.id == job.id
        meta = {"job_id": job.id, "sha256": sha, "chunks": 2, "embeddings": {"dim": 4}}
        out = write_folder(self.root / "outbox", output_name(name, sha, "m", settings),
                           {"summary.md": f"# {name}\n".encode(), "embeddings.npy": npy(3),
                            "meta.json": json.dumps(meta).encode(), OFFSETS_FILE: b"", TEXT_FILE: b""})
        assert self.queue.complete(job.id, PID, output_dir=str(out))
        self.dropped[sha] = name
        return sha


@pytest.fixture
def fake_home(tmp_path: Path) -> FakeHome:
    home = FakeHome(tmp_path / "home")
    home.finish("a.md", "first")
    home.finish("b.md", "second")
    return home


def test_a_home_where_each_document_was_processed_once_is_clean(fake_home: FakeHome) -> None:
    home = fake_home
    result = audit(home.root, home.dropped, originals_moved=True)
    assert result.clean, result.problems()
    assert result.processed == 2


def test_a_document_without_outputs_is_a_loss(fake_home: FakeHome) -> None:
    home = fake_home
    home.dropped[hashlib.sha256(b"never processed").hexdigest()] = "c.md"
    result = audit(home.root, home.dropped, originals_moved=True)
    assert len(result.losses) == 1 and "c.md" in result.losses[0] and not result.clean


def test_a_half_written_output_folder_is_a_loss(fake_home: FakeHome) -> None:
    home = fake_home
    sha, name = next(iter(home.dropped.items()))
    (home.root / "outbox" / output_name(name, sha, "m", "s") / "embeddings.npy").unlink()
    result = audit(home.root, home.dropped, originals_moved=True)
    assert result.losses == [f"{name}: output folder holds ['meta.json', 'offsets.npy', 'summary.md', 'text.txt.gz']"]


def test_the_same_document_done_twice_is_a_duplicate(fake_home: FakeHome) -> None:
    home = fake_home
    home.finish("a.md", "first", settings="other")  # the same content done by a second job
    result = audit(home.root, home.dropped, originals_moved=True)
    assert len(result.duplicates) == 1 and "a.md" in result.duplicates[0]


def test_leftover_temporaries_and_unknown_outputs_are_reported(fake_home: FakeHome) -> None:
    home = fake_home
    temporary_path(home.root / "outbox", "job9").mkdir()
    (home.root / "outbox" / "stranger-0000000").mkdir()
    result = audit(home.root, home.dropped, originals_moved=True)
    assert len(result.leftovers) == 1 and result.strays == ["outbox/stranger-0000000"] and not result.clean
