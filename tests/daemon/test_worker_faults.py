"""The worker when the machine fails, when it is stopped mid-chunk, and across restarts, on the tiny model."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.sqlite_errors import as_sqlalchemy_raises_it, locked

from npumoe.daemon import intake
from npumoe.daemon.cli.status_view import render_text, snapshot
from npumoe.daemon.home import Home
from npumoe.daemon.model_choice import load_engine
from npumoe.daemon.worker import Worker
from npumoe.engine.moe.model_experts import moe_experts
from npumoe.jobs import outputs
from npumoe.jobs.queue.store import Queue

PARAGRAPH = "The night shift files each report, checks the queue, and writes down what it could not finish.\n\n"


def in_background(action: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=action)
    thread.start()
    return thread


def test_a_full_disk_fails_no_job_says_so_in_status_and_every_document_completes_once_space_returns(
    npumoed_home: Home, queue: Queue, make_worker: Callable[..., Worker], monkeypatch: pytest.MonkeyPatch
) -> None:
    for number in range(3):
        (npumoed_home.inbox / f"report-{number}.md").write_text(f"# Report {number}\n\n" + PARAGRAPH * 4)
    real_write = outputs._write_durably
    disk = {"full": True, "refused": 0}

    def write_unless_full(path: Path, data: bytes, mode: int = 0o600) -> None:
        if disk["full"]:
            disk["refused"] += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real_write(path, data, mode)

    monkeypatch.setattr(outputs, "_write_durably", write_unless_full)
    seen: dict[str, Any] = {}

    def free_space_once_status_names_the_fault() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            row = queue.daemons.read()
            if row and "disk full" in (row["reason"] or ""):
                seen["status"] = render_text(snapshot(queue))
                seen["counts"] = queue.counts()
                seen["refused"] = disk["refused"]
                time.sleep(0.5)  # a few probes, all refused while the disk is still full
                seen["refused_later"] = disk["refused"]
                disk["full"] = False
                return
            time.sleep(0.05)

    freer = in_background(free_space_once_status_names_the_fault)
    summary = make_worker().run()
    freer.join()
    assert "waiting: disk full: " in seen["status"] and f"MB free in {npumoed_home.outbox}" in seen["status"]
    assert seen["counts"]["failed"] == seen["counts"]["dead"] == 0 and seen["counts"]["queued"] == 3
    assert seen["refused_later"] > seen["refused"] >= 1  # outputs refused, then the probes too
    jobs = queue.list()
    assert [(job.state, job.attempts, job.error_kind) for job in jobs] == [("done", 1, None)] * 3
    assert summary.outcomes["done"] == 3 and "failed" not in summary.outcomes and "dead" not in summary.outcomes
    outputs_named = sorted(Path(job.output_dir or "").name for job in jobs)
    assert sorted(p.name for p in npumoed_home.outbox.iterdir()) == outputs_named
    assert list(npumoed_home.failed.iterdir()) == []


def test_the_queue_database_locked_while_claiming_holds_the_work_and_ends_no_daemon(
    npumoed_home: Home, queue: Queue, make_worker: Callable[..., Worker], monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path
) -> None:
    (npumoed_home.inbox / "report.md").write_text("# Report\n\n" + PARAGRAPH * 4)
    locked_error = as_sqlalchemy_raises_it(locked(tmp_path))
    real_claim = Queue.claim
    refused = []

    def claim_once_locked(self: Queue, *args: Any, **kwargs: Any) -> Any:
        if not refused:
            refused.append(args)
            raise locked_error
        return real_claim(self, *args, **kwargs)

    monkeypatch.setattr(Queue, "claim", claim_once_locked)
    summary = make_worker().run()
    assert refused and dict(summary.outcomes) == {"done": 1}
    [job] = queue.list()
    assert (job.state, job.attempts) == ("done", 1)


def test_a_stop_takes_effect_before_the_next_model_layer_not_at_the_end_of_the_chunk(
    npumoed_home: Home, queue: Queue, make_worker: Callable[..., Worker]
) -> None:
    (npumoed_home.inbox / "long.md").write_text(PARAGRAPH * 40)
    layers = {"per_chunk": 0, "started": 0, "finished": 0, "finished_at_stop": -1}
    holder: list[Worker] = []

    def stop_in_the_second_chunk(*_: object) -> None:
        layers["started"] += 1
        if layers["started"] == layers["per_chunk"] + 2:  # the second layer of the second chunk
            layers["finished_at_stop"] = layers["finished"]
            holder[0].stop()

    def finished(*_: object) -> None:
        layers["finished"] += 1

    def loader(settings: Any) -> Any:
        engine = load_engine(settings)
        every = [experts for _, experts in moe_experts(engine.loaded.model)]
        layers["per_chunk"] = len(every)
        assert len(every) >= 2
        for experts in every:
            experts.register_forward_pre_hook(stop_in_the_second_chunk)  # before the worker's own check
            experts.register_forward_hook(finished)
        return engine

    holder.append(make_worker(loader=loader))
    summary = holder[0].run()
    [job] = queue.list()
    assert dict(summary.outcomes) == {"queued": 1} and (job.state, job.attempts) == ("queued", 0)
    # the chunk's first layer ran; the one it stopped before did not, nor any after it
    assert layers["finished_at_stop"] == layers["finished"] == layers["per_chunk"] + 1
    assert list(npumoed_home.outbox.iterdir()) == []


def test_a_restart_does_not_hash_an_unchanged_inbox_again(
    npumoed_home: Home, queue: Queue, make_worker: Callable[..., Worker], monkeypatch: pytest.MonkeyPatch
) -> None:
    kept = npumoed_home.inbox / "kept.md"
    kept.write_text(PARAGRAPH * 2)
    assert dict(make_worker().run().outcomes) == {"done": 1}
    assert list(queue.handed.all()) == [str(kept)]
    hashed: list[Path] = []
    real_identify = intake.identify

    def counted(path: Path, max_bytes: int | None = None) -> Any:
        hashed.append(path)
        return real_identify(path, max_bytes)

    monkeypatch.setattr(intake, "identify", counted)
    assert dict(make_worker().run().outcomes) == {}
    assert hashed == []  # remembered from the database: not read again
    kept.write_text(PARAGRAPH * 3)  # changed: read, hashed, queued and processed
    assert dict(make_worker().run().outcomes) == {"done": 1} and hashed == [kept]
    kept.unlink()
    make_worker().run()
    assert queue.handed.all() == {}  # a file that left the inbox is forgotten
