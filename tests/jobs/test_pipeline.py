"""One document through the pipeline: outputs and a done job, or a recorded reason, never a lost job.

The engine here is a stand-in that reports a few chunks and returns a fixed result, so these tests
specify the pipeline's own behaviour; the real engine runs in tests/daemon/test_e2e.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import hostile_files
import meta_fields
import numpy as np
import pytest

from npumoe.daemon.measure import Meter
from npumoe.engine import DocumentResult, EngineSettings, Progress, RunStats
from npumoe.engine.dispatch import DispatchStats
from npumoe.jobs import pipeline
from npumoe.jobs.errors import ExtractionError, Stop
from npumoe.jobs.extract import ExtractLimits
from npumoe.jobs.files import Folders
from npumoe.jobs.pipeline import Outcome, Pipeline, Policy
from npumoe.jobs.queue import Backoff, Job, Queue

PID = 4242
TEXT = "A short document about queues.\n\nIt has two paragraphs, which is plenty for a stand-in engine.\n"


@dataclass
class StandInEngine:
    chunks: int = 3
    error: Exception | None = None
    model_key: str = "stand-in@0"
    residency: None = None  # no plan: every expert on the exact CPU path
    texts: list[str] = field(default_factory=list)

    def process(self, text: str, on_progress: Callable[[Progress], None] | None = None) -> DocumentResult:
        self.texts.append(text)
        for done in range(1, self.chunks + 1):
            assert on_progress is not None
            on_progress(Progress("prefill", done, self.chunks, 10 * done, 10 * self.chunks, 0.5 * done))
        if self.error is not None:
            raise self.error
        stats = RunStats(tokens=10 * self.chunks, chunks=self.chunks, chunk_tokens=10, sections=1, reduce_rounds=0,
                         seconds={"prefill": 0.1, "summary": 0.2, "reduce": 0.0, "total": 0.3},
                         dispatch=DispatchStats())
        rows = np.arange((self.chunks + 1) * 4, dtype=np.float32).reshape(self.chunks + 1, 4)
        return DocumentResult(summary="The stand-in summary.", embeddings=rows, stats=stats)


@dataclass
class StandInModel:
    engine: StandInEngine = field(default_factory=StandInEngine)
    settings: EngineSettings = field(default_factory=lambda: EngineSettings(model="stand-in", summary_tokens=8))

    def load(self) -> StandInEngine:
        return self.engine


class Setup:
    """A queue, the four folders, and a pipeline over them, as the worker would build them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.inbox, self.outbox, self.processed, self.failed = (root / n for n in ("inbox", "out", "done", "failed"))
        for folder in (self.inbox, self.outbox, self.processed, self.failed):
            folder.mkdir(parents=True)
        self.queue = Queue(root / "queue.db", backoff=Backoff(base=0.0, cap=0.0))
        self.model = StandInModel()
        self.checkpoints = 0
        self.stop_at_checkpoint: int | None = None

    def pipeline(self, originals: str = "keep", max_bytes: int = 2**20) -> Pipeline:
        folders = Folders(self.outbox, self.processed, self.failed, (self.inbox.resolve(),))
        policy = Policy(originals, ExtractLimits(timeout_s=20, memory_mb=512, max_bytes=max_bytes), 60.0)
        return Pipeline(
            self.queue, folders, policy, self.model, worker_pid=PID, meter=Meter, checkpoint=self._checkpoint
        )

    def _checkpoint(self) -> None:
        self.checkpoints += 1
        if self.checkpoints == self.stop_at_checkpoint:
            raise Stop

    def document(self, name: str = "notes.md", text: str = TEXT, folder: Path | None = None) -> Path:
        path = (folder or self.inbox) / name
        path.write_text(text)
        return path

    def claim(self, path: Path, max_attempts: int = 3) -> Job:
        sha = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() and not path.is_symlink() else "0" * 64
        self.queue.add(path, sha, model_key="m", settings_key="s", max_attempts=max_attempts)
        job = self.queue.claim(PID, lease_seconds=60)
        assert job is not None
        return job

    def run(self, path: Path, originals: str = "keep", max_attempts: int = 3) -> tuple[Outcome, Job]:
        job = self.claim(path, max_attempts)
        outcome = self.pipeline(originals).process(job)
        after = self.queue.get(job.id)
        assert after is not None
        return outcome, after


@pytest.fixture
def setup(tmp_path: Path) -> Setup:
    return Setup(tmp_path)


def test_a_document_becomes_three_outputs_and_a_done_job(setup: Setup) -> None:
    outcome, job = setup.run(setup.document())
    assert outcome.state == "done" and job.state == "done"
    out = Path(job.output_dir or "")
    assert out.parent == setup.outbox and out.name == f"notes-{job.sha256[:8]}"
    assert sorted(p.name for p in out.iterdir()) == ["embeddings.npy", "meta.json", "summary.md"]
    assert np.load(out / "embeddings.npy").shape == (4, 4)  # three chunks plus the document vector
    summary = (out / "summary.md").read_text()
    assert summary.startswith("# notes.md\n") and "The stand-in summary." in summary
    meta = json.loads((out / "meta.json").read_text())
    assert meta["sha256"] == job.sha256 and meta["job_id"] == job.id and meta["source"] == job.path
    assert meta["model_key"] == "stand-in@0" and meta["tokens"] == 30 and meta["chunks"] == 3
    assert meta["extraction"]["format"] == "markdown" and meta["cpu_seconds"] >= 0
    assert meta["energy_joules"] is None or meta["energy_joules"] >= 0
    assert set(meta["seconds"]) >= {"extract", "prefill", "summary"}
    assert setup.model.engine.texts == [TEXT.strip()]
    assert [p.name for p in setup.outbox.iterdir()] == [out.name]  # the private copy is gone


def test_meta_json_holds_every_field_the_readme_documents_once_with_its_type(setup: Setup) -> None:
    _, job = setup.run(setup.document())
    meta = json.loads((Path(job.output_dir or "") / "meta.json").read_text())
    meta_fields.assert_documented_once(meta)
    assert meta["schema_version"] == 1


def test_progress_is_recorded_with_the_job_after_every_chunk(setup: Setup) -> None:
    recorded = []

    def peek() -> None:
        running = setup.queue.list("running")
        if running and running[0].detail:
            recorded.append(json.loads(running[0].detail))

    setup._checkpoint = peek  # type: ignore[method-assign]
    setup.run(setup.document())
    chunks = [(d["step"], d["steps"]) for d in recorded if d["phase"] == "prefill"]
    assert chunks == [(1, 3), (2, 3)]  # each seen by the checkpoint before the next chunk's report
    assert {"tokens_done", "tokens_total", "tokens_per_s", "eta_s"} <= set(recorded[-1])


@pytest.mark.parametrize(
    ("originals", "left_in_inbox", "in_processed"),
    [("keep", ["notes.md"], []), ("move", [], ["notes.md"]), ("delete", [], [])],
)
def test_the_original_is_kept_moved_or_deleted_by_policy(
    setup: Setup, originals: str, left_in_inbox: list[str], in_processed: list[str]
) -> None:
    outcome, _ = setup.run(setup.document(), originals)
    assert outcome.state == "done"
    assert [p.name for p in setup.inbox.iterdir()] == left_in_inbox
    assert [p.name for p in setup.processed.iterdir()] == in_processed


def test_a_document_queued_from_outside_the_inboxes_is_never_moved(setup: Setup) -> None:
    elsewhere = setup.root / "elsewhere"
    elsewhere.mkdir()
    outcome, _ = setup.run(setup.document(folder=elsewhere), "delete")
    assert outcome.state == "done" and (elsewhere / "notes.md").exists()


@pytest.mark.parametrize(
    ("case", "kind"),
    [
        ("zero_bytes", "empty"),
        ("whitespace_only", "empty"),
        ("binary_with_text_extension", "unsupported"),
        ("encrypted_pdf", "encrypted"),
        ("truncated_pdf", "corrupt"),
        ("truncated_docx", "corrupt"),
        ("huge_file", "too_large"),
    ],
)
def test_a_document_without_text_dies_with_its_reason_and_is_set_aside(setup: Setup, case: str, kind: str) -> None:
    make = getattr(hostile_files, case)
    path = make(setup.inbox, 2**21) if case == "huge_file" else make(setup.inbox)
    outcome, job = setup.run(path)
    assert (outcome.state, job.state, job.error_kind) == ("dead", "dead", kind)
    assert job.last_error and outcome.reason == job.last_error
    assert list(setup.inbox.iterdir()) == []
    error = setup.failed / f"{path.name}.error.txt"
    assert (setup.failed / path.name).exists() and job.last_error in error.read_text()
    assert list(setup.outbox.iterdir()) == []


def test_a_symlink_in_the_inbox_is_not_followed(setup: Setup) -> None:
    secret = setup.root / "secret.txt"
    secret.write_text("outside the inbox")
    link = setup.inbox / "link.txt"
    link.symlink_to(secret)
    _, job = setup.run(link)
    assert job.state == "dead" and "symbolic link" in (job.last_error or "")
    assert (setup.failed / "link.txt").is_symlink() and secret.read_text() == "outside the inbox"
    assert setup.model.engine.texts == []


def test_an_engine_failure_is_retried_with_backoff_then_the_job_dies(setup: Setup) -> None:
    setup.model.engine.error = RuntimeError("out of cheese")
    path = setup.document()
    outcome, job = setup.run(path, max_attempts=2)
    assert (outcome.state, job.error_kind) == ("failed", "engine") and "out of cheese" in (job.last_error or "")
    assert path.exists()  # still in the inbox while it may be retried
    again = setup.queue.claim(PID, lease_seconds=60)
    assert again is not None and again.id == job.id and again.attempts == 2
    assert setup.pipeline().process(again).state == "dead"
    assert (setup.failed / "notes.md.error.txt").exists()


def test_a_file_rewritten_after_it_was_queued_becomes_a_new_job(setup: Setup) -> None:
    path = setup.document()
    job = setup.claim(path)
    path.write_text(TEXT + "\nA third paragraph, added later.\n")
    outcome = setup.pipeline().process(job)
    old = setup.queue.get(job.id)
    assert old is not None and (old.state, old.error_kind) == ("dead", "changed")
    [new] = setup.queue.list("queued")
    assert new.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert f"job #{new.id}" in outcome.reason
    assert path.exists() and list(setup.failed.iterdir()) == []  # it belongs to the new job now


def test_a_file_deleted_after_it_was_queued_ends_with_that_reason(setup: Setup) -> None:
    path = setup.document()
    job = setup.claim(path)
    path.unlink()
    assert setup.pipeline().process(job).state == "dead"
    after = setup.queue.get(job.id)
    assert after is not None and after.error_kind == "missing" and "gone" in (after.last_error or "")


def test_stopping_mid_document_hands_the_job_back_untouched(setup: Setup) -> None:
    setup.stop_at_checkpoint = 4  # after extraction, between two chunks
    outcome, job = setup.run(setup.document())
    assert outcome.state == "queued"
    assert (job.state, job.attempts, job.progress) == ("queued", 0, 0.0)
    assert list(setup.outbox.iterdir()) == [] and (setup.inbox / "notes.md").exists()


def test_an_extractor_killed_by_the_same_stop_signal_does_not_fail_the_document(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    def killed(*_: object) -> None:
        raise ExtractionError("corrupt", "the parser crashed on this document (killed by SIGINT)")

    monkeypatch.setattr(pipeline, "extract_text", killed)
    setup.stop_at_checkpoint = 2  # Ctrl-C: the daemon is stopping when the extractor's death is reported
    outcome, job = setup.run(setup.document())
    assert (outcome.state, job.state, job.attempts, job.last_error) == ("queued", "queued", 0, None)


def test_a_job_cancelled_mid_document_writes_nothing(setup: Setup) -> None:
    def cancel_now() -> None:
        setup.checkpoints += 1
        if setup.checkpoints == 3:
            setup.queue.cancel(setup.queue.list("running")[0].id)

    setup._checkpoint = cancel_now  # type: ignore[method-assign]
    outcome, job = setup.run(setup.document())
    assert (outcome.state, job.state) == ("lost", "cancelled")
    assert list(setup.outbox.iterdir()) == []


def test_outputs_a_killed_attempt_completed_are_kept_not_recomputed(setup: Setup) -> None:
    path = setup.document()
    first, _ = setup.run(path)
    # As if the daemon died after writing the outputs but before marking the job done:
    with sqlite3.connect(setup.root / "queue.db") as db:
        db.execute("UPDATE jobs SET state = 'running', worker_pid = ?", (PID,))
    job = setup.queue.get(1)
    assert job is not None
    setup.model.engine.texts.clear()
    outcome = setup.pipeline().process(job)
    assert outcome.state == "done" and outcome.output_dir == first.output_dir
    assert setup.model.engine.texts == []


def test_failing_to_move_the_original_never_loses_the_result(setup: Setup) -> None:
    setup.processed.rmdir()
    setup.processed.write_text("a file where the folder should be")
    outcome, job = setup.run(setup.document(), "move")
    assert (outcome.state, job.state) == ("done", "done")
    assert (Path(job.output_dir or "") / "meta.json").exists()
    assert (setup.inbox / "notes.md").exists()


def test_a_file_name_with_a_newline_gets_a_safe_output_folder(setup: Setup) -> None:
    outcome, job = setup.run(setup.document("two\nlines.txt"))
    assert outcome.state == "done"
    assert Path(job.output_dir or "").name == f"two_lines-{job.sha256[:8]}"
    assert os.listdir(setup.outbox) == [f"two_lines-{job.sha256[:8]}"]
