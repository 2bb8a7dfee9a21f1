"""One document through the pipeline: outputs and a done job, or a recorded reason, never a lost job.

The engine here is a stand-in (stand_in_engine.py), so these tests specify the pipeline's own behaviour.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import sqlite3
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import update
from stand_in_engine import StandInModel
from support import hostile_files, meta_fields
from support.postgres_server import PostgresServer
from support.sqlite_errors import as_sqlalchemy_raises_it, disk_full, locked

from npumoe.daemon.energy.measure import Meter
from npumoe.jobs import files, outputs, reading
from npumoe.jobs.errors import ExtractionError, FileRefused, MissingDependency, Stop
from npumoe.jobs.extract.isolated import ExtractLimits
from npumoe.jobs.faults import READ_FAULTS, MachineFault
from npumoe.jobs.files import Folders
from npumoe.jobs.outcomes import Outcome
from npumoe.jobs.outputs import displaced_path, output_name, read_text
from npumoe.jobs.pipeline import Pipeline, Policy
from npumoe.jobs.queue.schema import jobs
from npumoe.jobs.queue.store import HANDBACKS, Backoff, Job, Queue
from npumoe.jobs.search import sentence_model as sentence_model_module
from npumoe.jobs.search.index import SearchIndex, reindex, stale_reason

TEXT = "A short document about queues.\n\nIt has two paragraphs, which is plenty for a stand-in engine.\n"


class Setup:
    """A queue, the four folders, and a pipeline over them, as the worker would build them."""

    def __init__(self, root: Path, folders: Folders, queue: Queue, model: StandInModel, claim: Callable[..., Job],
                 pid: int) -> None:
        self.root, self.folders, self.queue, self.model, self.pid = root, folders, queue, model, pid
        self.inbox, self.outbox, self.processed, self.failed = (
            folders.inboxes[0], folders.outbox, folders.processed, folders.failed)
        self._claim = claim
        self.checkpoints = 0
        self.stop_at_checkpoint: int | None = None

    def pipeline(self, originals: str = "keep", max_bytes: int = 2**20) -> Pipeline:
        policy = Policy(originals, ExtractLimits(timeout_s=20, memory_mb=512, max_bytes=max_bytes), 60.0)
        return Pipeline(
            self.queue, self.folders, policy, self.model, worker_pid=self.pid, meter=Meter,
            checkpoint=self._checkpoint,
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
        return self._claim(self.queue, path, max_attempts)

    def run(self, path: Path, originals: str = "keep", max_attempts: int = 3) -> tuple[Outcome, Job]:
        job = self.claim(path, max_attempts)
        outcome = self.pipeline(originals).process(job)
        after = self.queue.get(job.id)
        assert after is not None
        return outcome, after


@pytest.fixture
def setup(tmp_path: Path, inbox_folders: Folders, queue: Queue, stand_in_model: StandInModel, claim: Callable[..., Job],
          worker_pid: int) -> Setup:
    return Setup(tmp_path, inbox_folders, queue, stand_in_model, claim, worker_pid)


def test_a_document_becomes_five_outputs_and_a_done_job(setup: Setup) -> None:
    outcome, job = setup.run(setup.document())
    assert outcome.state == "done" and job.state == "done"
    out = Path(job.output_dir or "")
    assert out.parent == setup.outbox
    assert out.name == output_name("notes.md", job.sha256, job.model_key, job.settings_key)
    assert sorted(p.name for p in out.iterdir()) == [
        "embeddings.npy", "meta.json", "offsets.npy", "summary.md", "text.txt.gz"]
    assert np.load(out / "embeddings.npy").shape == (4, 4)  # three chunks plus the document vector
    assert read_text(out) == TEXT.strip()  # the text the engine read, kept for showing passages
    assert np.load(out / "offsets.npy").tolist() == [[0, 31], [31, 62], [62, 93]]
    summary = (out / "summary.md").read_text()
    assert summary.startswith("# notes.md\n") and "The stand-in summary." in summary
    meta = json.loads((out / "meta.json").read_text())
    assert meta["sha256"] == job.sha256 and meta["job_id"] == job.id and meta["source"] == job.path
    assert meta["model_key"] == "stand-in@0" and meta["tokens"] == 30 and meta["chunks"] == 3
    assert (meta["weights"], meta["dtype"]) == ("bf16", "bfloat16")  # the engine's own, not auto as asked
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
    again = setup.queue.claim(setup.pid, lease_seconds=60)
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


def test_on_a_shared_queue_a_rewritten_file_is_queued_again_pinned_to_the_machine_that_read_it(
    setup: Setup, postgres: PostgresServer
) -> None:
    setup.queue = Queue(postgres.new_database(), host="alpha", backoff=Backoff(base=0.0, cap=0.0))
    path = setup.document()
    job = setup.claim(path)
    assert job.pinned_host is None  # added as a path every machine may read
    path.write_text(TEXT + "\nA third paragraph, added later.\n")
    setup.pipeline().process(job)
    [new] = setup.queue.list("queued")
    assert new.pinned_host == "alpha"  # what alpha read is alpha's file: no other machine may publish it
    setup.queue.close()


def test_a_file_deleted_after_it_was_queued_ends_with_that_reason(setup: Setup) -> None:
    path = setup.document()
    job = setup.claim(path)
    path.unlink()
    assert setup.pipeline().process(job).state == "dead"
    after = setup.queue.get(job.id)
    assert after is not None and after.error_kind == "missing" and "gone" in (after.last_error or "")


def test_stopping_mid_document_hands_the_job_back_untouched(setup: Setup) -> None:
    setup.stop_at_checkpoint = 4  # after extraction, within the second chunk
    outcome, job = setup.run(setup.document())
    assert outcome.state == "queued"
    assert (job.state, job.attempts, job.progress) == ("queued", 0, 0.0)
    assert list(setup.outbox.iterdir()) == [] and (setup.inbox / "notes.md").exists()


def test_an_extractor_killed_by_the_same_stop_signal_does_not_fail_the_document(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    def killed(*_: object) -> None:
        raise ExtractionError("corrupt", "the parser crashed on this document (killed by SIGINT)")

    monkeypatch.setattr(reading, "extract_text", killed)
    setup.stop_at_checkpoint = 2  # Ctrl-C: the daemon is stopping when the extractor's death is reported
    outcome, job = setup.run(setup.document())
    assert (outcome.state, job.state, job.attempts, job.last_error) == ("queued", "queued", 0, None)


def test_a_document_refused_for_a_permission_is_tried_again_with_the_reason_it_was_refused(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    def denied(*_: object) -> None:  # as open_regular refuses a file of mode 000 (root reads it anyway)
        raise FileRefused("unreadable", "cannot read the file: permission denied", denied=True)

    monkeypatch.setattr(reading, "snapshot", denied)
    path = setup.document()
    outcome, job = setup.run(path)
    assert (outcome.state, job.error_kind, job.last_error) == ("failed", "unreadable",
                                                               "cannot read the file: permission denied")
    assert path.exists()  # a person may put the permission right: it stays in the inbox meanwhile


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
        db.execute("UPDATE jobs SET state = 'running', worker_pid = ?", (setup.pid,))
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
    name = output_name("two\nlines.txt", job.sha256, job.model_key, job.settings_key)
    assert name.startswith("two_lines-") and Path(job.output_dir or "").name == name
    assert os.listdir(setup.outbox) == [name]


# -- faults of the machine, and originals that changed ----------------------------------------------------


class FailingOpen:
    """`os` as jobs/files.py sees it, except that opening `path` fails with `code` (counted) while `failing`."""

    def __init__(self, path: Path, code: int) -> None:
        self.target, self.code, self.failing, self.calls = str(path), code, True, 0

    def __getattr__(self, name: str) -> object:
        return getattr(os, name)

    def open(self, path: object, *args: object, **kwargs: object) -> int:
        # The document is opened by its name within its folder's descriptor (open_regular walks the path).
        if self.failing and os.fspath(path) == os.path.basename(self.target) and "dir_fd" in kwargs:  # type: ignore[arg-type]
            self.calls += 1
            raise OSError(self.code, os.strerror(self.code), self.target)
        return os.open(path, *args, **kwargs)  # type: ignore[arg-type]


def backoff_waited_out(queue: Queue) -> None:
    """Every waiting job runnable now, keeping their order (the order `claim` takes them in is the test)."""
    with queue.db.tx() as conn:
        conn.execute(update(jobs).values(run_after=jobs.c.run_after - 1e6))


@pytest.mark.parametrize("code", [errno.EIO, errno.ESTALE])
def test_an_io_error_reading_the_inbox_costs_no_attempt_nor_sets_the_document_aside(
    setup: Setup, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    path = setup.document()
    failing = FailingOpen(path, code)
    monkeypatch.setattr(files, "os", failing)
    job = setup.claim(path, max_attempts=1)
    for _ in range(HANDBACKS):  # more tries than the job has attempts: none of them is spent
        with pytest.raises(MachineFault, match=str(setup.inbox)) as fault:
            setup.pipeline("delete").process(job)
        assert fault.value.code == code and fault.value.cleared()  # transient: the folder itself lists fine
        after = setup.queue.get(job.id)
        assert after is not None and (after.state, after.attempts, after.last_error) == ("queued", 0, str(fault.value))
        backoff_waited_out(setup.queue)
        job = setup.queue.claim(setup.pid, lease_seconds=60) or job
    assert failing.calls == HANDBACKS and path.exists() and list(setup.failed.iterdir()) == []
    failing.failing = False  # the share is back
    assert setup.pipeline().process(job).state == "done"


@pytest.mark.parametrize("code", [errno.EIO, errno.ESTALE])
def test_a_file_whose_reads_keep_failing_lets_the_queue_go_on_then_is_set_aside_with_its_reason(
    setup: Setup, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    bad, good = setup.document("bad.md"), setup.document("good.md", TEXT + "Another one.\n")
    monkeypatch.setattr(files, "os", FailingOpen(bad, code))
    for path in (bad, good):
        setup.queue.add(path, hashlib.sha256(path.read_bytes()).hexdigest(), model_key="m", settings_key="s",
                        max_attempts=2)
    claimed, done = [], []
    for _ in range(30):  # at most two attempts of five hand-backs each for the bad file, one claim for the good
        backoff_waited_out(setup.queue)
        job = setup.queue.claim(setup.pid, lease_seconds=60)
        if job is None:
            break
        claimed.append(Path(job.path).name)
        with contextlib.suppress(MachineFault):  # the worker waits until the folder probes well: at once here
            done.append(setup.pipeline().process(job).state)
    assert claimed[:2] == ["bad.md", "good.md"]  # the file handed back does not come first again
    assert claimed.count("bad.md") == 2 * (HANDBACKS + 1) and done == ["done", "failed", "dead"]
    [after] = [j for j in setup.queue.list() if j.path == str(bad)]
    assert (after.state, after.attempts, after.error_kind) == ("dead", 2, "machine")
    assert after.last_error is not None and after.last_error.startswith(READ_FAULTS[code])
    assert (setup.failed / "bad.md").exists() and not bad.exists()
    assert "kind: machine" in (setup.failed / "bad.md.error.txt").read_text()


def test_a_missing_package_is_the_machines_fault_and_clears_once_it_imports(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def without_cryptography(path: Path, limits: ExtractLimits) -> None:
        calls.append(path)
        raise MissingDependency("reading this PDF needs a package that is not installed", "cryptography")

    monkeypatch.setattr(reading, "extract_text", without_cryptography)
    path = setup.document()
    job = setup.claim(path, max_attempts=1)
    with pytest.raises(MachineFault, match="the Python module 'cryptography' cannot be imported") as fault:
        setup.pipeline().process(job)
    assert calls and fault.value.module == "cryptography" and fault.value.cleared()  # it is installed here
    after = setup.queue.get(job.id)
    assert after is not None and (after.state, after.attempts) == ("queued", 0) and path.exists()


def test_a_full_disk_hands_the_job_back_and_says_how_much_is_free(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    written: list[Path] = []
    real_write = outputs._write_durably

    def full(path: Path, data: bytes, mode: int = 0o600) -> None:
        written.append(path)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(outputs, "_write_durably", full)
    path = setup.document()
    job = setup.claim(path, max_attempts=1)
    with pytest.raises(MachineFault) as fault:
        setup.pipeline().process(job)
    assert written and re.fullmatch(rf"disk full: [\d,]+ MB free in {re.escape(str(setup.outbox))}", str(fault.value))
    assert not fault.value.cleared()  # the probe writes through the same (full) path
    after = setup.queue.get(job.id)
    assert after is not None and (after.state, after.attempts) == ("queued", 0)
    assert os.listdir(setup.outbox) == []  # no half-written output, no leftover temporary
    monkeypatch.setattr(outputs, "_write_durably", real_write)
    assert fault.value.cleared()
    again = setup.queue.claim(setup.pid, lease_seconds=60)
    assert again is not None and setup.pipeline().process(again).state == "done"


def test_the_queue_database_full_while_marking_a_job_done_blames_no_document(
    setup: Setup, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    full = as_sqlalchemy_raises_it(disk_full(tmp_path))
    real_complete = Queue.complete
    tried = []

    def complete_once_full(queue: Queue, *args: object, **kwargs: object) -> bool:
        tried.append(args)
        if len(tried) == 1:
            raise full
        return real_complete(queue, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Queue, "complete", complete_once_full)
    job = setup.claim(setup.document(), max_attempts=1)
    with pytest.raises(MachineFault, match=r"^disk full: .* in the queue database ") as fault:
        setup.pipeline().process(job)
    assert fault.value.folder == setup.root and fault.value.code == errno.ENOSPC
    after = setup.queue.get(job.id)
    assert after is not None and (after.state, after.attempts, after.error_kind) == ("queued", 0, "machine")
    again = setup.queue.claim(setup.pid, lease_seconds=60)
    assert again is not None and setup.pipeline().process(again).state == "done" and len(tried) == 2


def test_a_failure_the_locked_database_would_not_record_is_recorded_later_and_the_worker_goes_on(
    setup: Setup, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    locked_error = as_sqlalchemy_raises_it(locked(tmp_path))
    real_fail = Queue.fail
    database = {"locked": True}

    def fail_unless_locked(queue: Queue, *args: object, **kwargs: object) -> str | None:
        if database["locked"]:
            raise locked_error
        return real_fail(queue, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Queue, "fail", fail_unless_locked)
    monkeypatch.setattr(reading, "extract_text", refuse_as_corrupt)
    job = setup.claim(setup.document(), max_attempts=1)
    worker = setup.pipeline()
    with pytest.raises(MachineFault, match=r"^the database is busy") as fault:
        worker.process(job)
    assert fault.value.code == errno.EBUSY and list(worker.outcomes.unsettled) == [job.id]
    with pytest.raises(MachineFault):
        worker.record_unsettled()  # still locked: it waits for the next call
    running = setup.queue.get(job.id)
    assert running is not None and running.state == "running" and running.worker_pid == setup.pid  # still this worker's
    database["locked"] = False
    worker.record_unsettled()
    after = setup.queue.get(job.id)
    assert after is not None and (after.state, after.error_kind) == ("dead", "corrupt")
    assert worker.outcomes.unsettled == {}
    assert (setup.failed / "notes.md").exists()  # set aside once the failure was recorded


def refuse_as_corrupt(path: Path, limits: ExtractLimits) -> None:
    raise ExtractionError("corrupt", "not a document at all")


def test_a_long_cjk_name_gives_names_that_fit_in_255_bytes(setup: Setup) -> None:
    name = "長い日本語の報告書" * 8 + "第二版の要約.md"  # 78 characters (234 bytes of UTF-8), then ".md"
    assert len(name) == 81  # once over 255 bytes as a temporary name: ".tmp-" + 234 + "-key16" + "-hex8" + ".old"
    outcome, job = setup.run(setup.document(name))
    assert outcome.state == "done"
    out = Path(job.output_dir or "")
    assert out.name.startswith("長い日本語の報告書")
    assert out.name == output_name(name, job.sha256, job.model_key, job.settings_key)
    longest = displaced_path(setup.outbox, out.name).name  # what replacing that output would be called
    assert len(out.name.encode()) <= len(longest.encode()) <= 255


@pytest.mark.skipif(sys.platform == "darwin", reason="APFS only takes UTF-8 names")
def test_a_name_that_is_not_utf8_is_stored_losslessly_and_processed(setup: Setup) -> None:
    raw = os.fsencode(setup.inbox) + b"/r\xe9sum\xe9 \xff.txt"  # Latin-1 bytes, as an old archive might hold
    with open(raw, "wb") as f:
        f.write(TEXT.encode())
    path = Path(os.fsdecode(raw))
    outcome, job = setup.run(path, "move")
    assert outcome.state == "done" and os.fsencode(job.path) == raw
    assert os.listdir(os.fsencode(setup.processed)) == [b"r\xe9sum\xe9 \xff.txt"]
    meta = json.loads((Path(job.output_dir or "") / "meta.json").read_text())
    assert meta["source"].endswith("r\\xe9sum\\xe9 \\xff.txt")


@pytest.mark.parametrize("originals", ["delete", "move"])
def test_a_file_saved_again_after_its_snapshot_is_not_settled_and_its_new_content_is_queued(
    setup: Setup, originals: str
) -> None:
    path = setup.document()
    new_text = TEXT + "\nSaved again while the first version was being read.\n"

    def save_again_after_the_snapshot() -> None:
        setup.checkpoints += 1
        if setup.checkpoints == 1:  # the first checkpoint comes right after the snapshot
            replacement = setup.root / "editor-temp"
            replacement.write_text(new_text)
            os.replace(replacement, path)  # how editors save: a new file renamed over the old one

    setup._checkpoint = save_again_after_the_snapshot  # type: ignore[method-assign]
    outcome, job = setup.run(path, originals)
    assert outcome.state == "done" and job.sha256 == hashlib.sha256(TEXT.encode()).hexdigest()
    assert path.read_text() == new_text and list(setup.processed.iterdir()) == []
    [new] = setup.queue.list("queued")
    assert new.sha256 == hashlib.sha256(new_text.encode()).hexdigest() and new.path == job.path


def test_a_done_document_is_in_the_search_index(setup: Setup) -> None:
    _, job = setup.run(setup.document())
    index = SearchIndex(setup.root / "queue.db")
    try:
        (itself,) = index.similar(job.id, 5)
    finally:
        index.close()
    assert itself.document.job_id == job.id and itself.document.output_dir == job.output_dir


def test_on_a_shared_queue_a_done_document_is_indexed_in_this_machines_own_database(
    setup: Setup, postgres: PostgresServer
) -> None:
    setup.queue = Queue(postgres.new_database(), backoff=Backoff(base=0.0, cap=0.0))
    local = setup.root / "home.db"
    job = setup.claim(setup.document())
    pipeline_ = setup.pipeline()
    pipeline_.local_index = local
    assert pipeline_.process(job).state == "done"
    index = SearchIndex(local)
    try:
        (itself,) = index.similar(job.id, 5)
    finally:
        index.close()
    assert itself.document.job_id == job.id


def test_a_search_model_that_cannot_load_fails_no_document_and_flags_the_index(
        setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> None:
        raise OSError("the search model is not in the models cache")

    monkeypatch.setattr(sentence_model_module, "sentence_model", missing)
    outcome, job = setup.run(setup.document())
    assert outcome.state == job.state == "done" and job.last_error is None
    reason = stale_reason(setup.root / "queue.db")
    assert reason is not None and "the search model is not in the models cache" in reason


def test_a_damaged_search_index_fails_no_document_and_is_flagged_for_reindex(setup: Setup) -> None:
    setup.run(setup.document())
    database = setup.root / "queue.db"
    with sqlite3.connect(database) as conn:  # the FTS structure record zeroed: quick_check still finds nothing
        conn.execute("UPDATE search_words_data SET block = zeroblob(length(block)) WHERE id = 10")
        assert conn.execute("PRAGMA quick_check").fetchall() == [("ok",)]
    outcome, job = setup.run(setup.document("second.md", TEXT + "And a second document.\n"))
    assert outcome.state == job.state == "done" and job.last_error is None
    assert (reason := stale_reason(database)) is not None and reason.startswith(f"job {job.id} was not added: ")
    assert reindex(database, setup.outbox).documents == 2 and stale_reason(database) is None
    index = SearchIndex(database)
    try:
        assert {n.document.job_id for n in index.similar(job.id, 5)} == {1, 2}
    finally:
        index.close()


def test_a_documents_private_copy_is_made_in_the_home_never_in_the_outbox(setup: Setup) -> None:
    """An outbox may be shared storage that the start-up clean-up never sweeps: a copy left there by a kill
    would stay for ever, on the share. The home (processed/'s and failed/'s folder) is swept at every start."""
    seen: list[tuple[list[str], list[Path]]] = []

    def look_while_it_runs() -> None:
        seen.append(([p.name for p in setup.outbox.iterdir()], sorted(setup.root.glob(".tmp-job*/*"))))

    setup._checkpoint = look_while_it_runs  # type: ignore[method-assign]
    outcome, _ = setup.run(setup.document())
    assert outcome.state == "done" and seen
    in_outbox, in_home = seen[0]  # the first checkpoint comes straight after the copy is made
    assert in_outbox == []
    assert [p.name for p in in_home] == ["document.md"]
    assert list(setup.root.glob(".tmp-job*")) == []  # and it goes when the job ends
