"""`npumoed status`: the daemon's state, the queue, the running document, recent results, why it waits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from npumoe.daemon.cli.status_view import render_rich, render_text, snapshot
from npumoe.jobs.queue.store import Queue

NOW = 1_800_000_000.0


@pytest.fixture
def queue(tmp_path: Path) -> Queue:
    return Queue(tmp_path / "npumoed.db", clock=lambda: NOW - 60)


def add(queue: Queue, name: str) -> int:
    job, _ = queue.add(f"/inbox/{name}", name.ljust(64, "0"), model_key="m", settings_key="s")
    return job.id


def a_running_daemon(queue: Queue, now: float = NOW) -> int:
    """A heartbeat row for this very process (so its pid is alive), working on a job halfway through."""
    job_id = add(queue, "long.md")
    claimed = queue.claim(os.getpid(), lease_seconds=600)
    assert claimed is not None and claimed.id == job_id
    detail = {
        "phase": "prefill",
        "step": 12,
        "steps": 30,
        "tokens_done": 6000,
        "tokens_total": 15000,
        "tokens_per_s": 1500.0,
        "eta_s": 6.0,
    }
    queue.heartbeat(job_id, os.getpid(), lease_seconds=600, progress=0.4, detail=detail)
    queue.daemons.write(
        pid=os.getpid(),
        started_at=now - 3725,
        heartbeat_at=now - 1,
        stopped_at=None,
        activity="working",
        reason="",
        current_job=job_id,
        model="demo",
        backend="torch-static",
        power={"on_ac": True},
        counters={"done": 3, "model_loaded": 1},
    )
    return job_id


def test_a_home_where_the_daemon_never_ran(queue: Queue) -> None:
    snap = snapshot(queue, now=NOW)
    assert snap["daemon"] == {"state": "never started"}
    assert snap["current"] is None and snap["queue"]["queued"] == 0
    assert "has not run" in render_text(snap)


def test_a_running_daemon_shows_its_pid_uptime_model_and_current_progress(queue: Queue) -> None:
    job_id = a_running_daemon(queue)
    snap = snapshot(queue, now=NOW)
    daemon, current = snap["daemon"], snap["current"]
    assert (daemon["state"], daemon["pid"], daemon["uptime_s"]) == ("running", os.getpid(), 3725)
    assert (current["id"], current["step"], current["steps"], current["progress"]) == (job_id, 12, 30, 0.4)
    text = render_text(snap)
    for fact in (
        f"pid {os.getpid()}",
        "up 1h02m",
        "model demo (loaded) on torch-static",
        f"#{job_id} /inbox/long.md",
        "40%",
        "prefill 12/30 chunks",
        "6,000/15,000 tokens",
        "1,500 tok/s",
        "ETA 6s",
        "1 running",
    ):
        assert fact in text


def test_a_waiting_daemon_says_why(queue: Queue) -> None:
    queue.daemons.write(
        pid=os.getpid(),
        started_at=NOW - 10,
        heartbeat_at=NOW,
        stopped_at=None,
        activity="waiting",
        reason="on battery (42%)",
        current_job=None,
        model="demo",
        backend="cpu",
    )
    assert "waiting: on battery (42%)" in render_text(snapshot(queue, now=NOW))


def test_a_reason_naming_a_folder_reaches_the_terminal_without_its_escape_sequences(queue: Queue) -> None:
    """The daemon's reason can quote a folder's name, and a name can hold what a terminal obeys."""
    queue.daemons.write(
        pid=os.getpid(),
        started_at=NOW - 10,
        heartbeat_at=NOW,
        stopped_at=None,
        activity="waiting",
        reason="inbox /home/p/\x1b]0;owned\x07\x1b[2Jdocs is not a folder",
        current_job=None,
        model="demo",
        backend="cpu",
    )
    console = Console(record=True, width=200, color_system=None)
    console.print(render_rich(snapshot(queue, now=NOW)))
    for drawn in (render_text(snapshot(queue, now=NOW)), console.export_text()):
        assert "\x1b" not in drawn and "\x07" not in drawn
        assert "waiting: inbox /home/p/?]0;owned??[2Jdocs is not a folder" in drawn


def test_a_daemon_that_stopped_cleanly_or_was_killed_is_shown_stopped(queue: Queue) -> None:
    queue.daemons.write(
        pid=os.getpid(),
        started_at=NOW - 10,
        heartbeat_at=NOW - 5,
        stopped_at=NOW - 5,
        activity="stopped",
        reason="",
        current_job=None,
        model="demo",
        backend="cpu",
    )
    assert snapshot(queue, now=NOW)["daemon"]["state"] == "stopped"
    gone = subprocess.Popen(["true"])
    gone.wait()
    queue.daemons.write(pid=gone.pid, stopped_at=None, activity="working")  # killed: no clean stop recorded
    snap = snapshot(queue, now=NOW)
    assert (snap["daemon"]["state"], snap["daemon"]["activity"]) == ("stopped", "stopped")


def test_a_live_daemon_with_an_old_heartbeat_is_not_responding(queue: Queue) -> None:
    queue.daemons.write(
        pid=os.getpid(),
        started_at=NOW - 600,
        heartbeat_at=NOW - 120,
        stopped_at=None,
        activity="working",
        reason="",
        current_job=None,
        model="demo",
        backend="cpu",
    )
    assert snapshot(queue, now=NOW)["daemon"]["state"] == "not responding"


def test_recent_completions_and_failures_carry_their_outputs_and_reasons(queue: Queue) -> None:
    for name in ("a.md", "b.pdf", "c\nd.txt"):
        add(queue, name)
    pid = 77
    first = queue.claim(pid, lease_seconds=60)
    assert first is not None
    queue.complete(first.id, pid, output_dir="/outbox/a-00000000")
    second = queue.claim(pid, lease_seconds=60)
    assert second is not None
    queue.fail(second.id, pid, "PDF is encrypted (password required)", kind="encrypted", retryable=False)
    third = queue.claim(pid, lease_seconds=60)
    assert third is not None
    queue.fail(third.id, pid, "the engine failed: RuntimeError", kind="engine")
    snap = snapshot(queue, now=NOW)
    assert [j["output_dir"] for j in snap["recent_done"]] == ["/outbox/a-00000000"]
    assert {(j["state"], j["kind"]) for j in snap["recent_failures"]} == {("dead", "encrypted"), ("failed", "engine")}
    text = render_text(snap)
    assert "b.pdf: dead (encrypted): PDF is encrypted (password required)" in text
    assert "c?d.txt: failed (engine, retry at" in text  # a newline in a name never breaks a line


def test_the_rich_view_draws_the_same_facts(queue: Queue) -> None:
    a_running_daemon(queue)
    console = Console(record=True, width=120, color_system=None)
    console.print(render_rich(snapshot(queue, now=NOW)))
    drawn = console.export_text()
    assert "npumoed running" in drawn and "prefill 12/30 chunks" in drawn and "━" in drawn


def test_the_command_prints_json_for_scripts_and_plain_text_to_a_pipe(
    home: Path, npumoed: Callable[..., subprocess.CompletedProcess[str]]
) -> None:
    fresh = npumoed("status", "--json")
    assert fresh.returncode == 0 and json.loads(fresh.stdout)["daemon"]["state"] == "never started"
    home.mkdir(parents=True)
    a_running_daemon(Queue(home / "npumoed.db"), now=time.time())
    piped = npumoed("status")
    assert piped.returncode == 0 and "npumoed running" in piped.stdout and "\x1b[" not in piped.stdout
    as_json = json.loads(npumoed("status", "--json").stdout)
    assert as_json["home"] == str(home) and as_json["current"]["steps"] == 30


def test_a_queue_still_being_created_reads_as_not_started(
    home: Path, npumoed: Callable[..., subprocess.CompletedProcess[str]]
) -> None:
    home.mkdir(parents=True)
    (home / "npumoed.db").touch()  # the first daemon has made the file, not yet its tables
    result = npumoed("status", "--json")
    assert result.returncode == 0 and json.loads(result.stdout)["daemon"]["state"] == "never started"


def test_watch_keeps_printing_fresh_views_until_interrupted(
    home: Path, start_npumoed: Callable[..., Any], wait_for: Callable[..., bool]
) -> None:
    home.mkdir(parents=True)
    a_running_daemon(Queue(home / "npumoed.db"), now=time.time())
    watching = start_npumoed("status", "--watch", "--interval", "0.2", terminal=True)  # Ctrl-C, as a person's
    assert wait_for(lambda: watching.output().count("npumoed running") >= 3)
    watching.process.send_signal(signal.SIGINT)
    try:
        assert watching.process.wait(timeout=30) == 0
    except subprocess.TimeoutExpired:  # what the process made of SIGINT, for whoever reads the failure
        masks = [line for line in Path(f"/proc/{watching.process.pid}/status").read_text().splitlines()
                 if line.startswith(("SigBlk", "SigIgn", "SigCgt"))]
        pytest.fail(f"status --watch outlived SIGINT by 30 s; {masks}; its output ends: {watching.output()[-2000:]}")
