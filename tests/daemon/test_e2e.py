"""The daemon as a person runs it: real `npumoed run` processes, a real watched folder, the tiny model."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy.exc import OperationalError
from support import hostile_files, meta_fields

from npumoe.jobs.queue.store import Queue

PARAGRAPH = (
    "Every evening the archive grows by a few reports, and every night a quiet worker reads them, one chunk "
    "at a time, writing a short summary beside each before the morning comes.\n\n"
)
# Failures whose reason is known before any retry: each must end dead, with its kind, while the daemon goes on.
HOSTILE = {
    "truncated_pdf": "corrupt",
    "zero_bytes": "empty",
    "binary_with_text_extension": "unsupported",
    "encrypted_pdf": "encrypted",
}


@pytest.fixture
def daemon_home(home: Path, configure: Callable[[str], Path], tiny_model: Path) -> Path:
    """A home whose daemon runs the tiny model in short chunks and notices files quickly."""
    configure(f"""
[inbox]
stable_seconds = 0.5
rescan_seconds = 5

[model]
name = "{tiny_model}"
chunk_tokens = 64
summary_tokens = 8

[extract]
max_mb = 0.5
timeout_seconds = 30

[queue]
retry_base_seconds = 1

[scheduler]
max_foreground_load = 1.0  # other test runs share these cores; their load is not what this test is about
poll_seconds = 0.5

[cpu]
threads = 1
background_priority = false  # at SCHED_IDLE on a busy shared machine the test could starve
""")
    (home / "inbox").mkdir()
    return home


def jobs(home: Path) -> list[dict]:
    """Every job, read the way `npumoed status` reads them; none while the daemon is still creating the queue."""
    if not (home / "npumoed.db").exists():
        return []
    queue = Queue(home / "npumoed.db", read_only=True)
    try:
        return [job.as_dict() for job in queue.list()]
    except OperationalError:
        return []
    finally:
        queue.close()


def finished(home: Path, count: int) -> Callable[[], bool]:
    return lambda: sum(j["state"] in ("done", "dead") for j in jobs(home)) >= count


def assert_complete_outputs(job: dict) -> None:
    out = Path(job["output_dir"])
    meta = json.loads((out / "meta.json").read_text())
    assert meta["job_id"] == job["id"] and meta["sha256"] == job["sha256"]
    meta_fields.assert_documented_once(meta)  # written by the real engine, every figure once
    assert np.load(out / "embeddings.npy").shape == (meta["chunks"] + 1, meta["embeddings"]["dim"])
    assert (out / "summary.md").read_text().startswith(f"# {Path(job['path']).name}")


def stop(daemon: Any) -> int:
    daemon.process.send_signal(signal.SIGTERM)
    return daemon.process.wait(timeout=60)


def test_a_running_daemon_turns_dropped_files_into_outputs_and_bad_ones_into_reasons(
    daemon_home: Path,
    start_npumoed: Callable[..., Any],
    npumoed: Callable[..., subprocess.CompletedProcess[str]],
    wait_for: Callable[..., bool],
) -> None:
    inbox = daemon_home / "inbox"
    daemon = start_npumoed("run")
    assert wait_for(lambda: json.loads(npumoed("status", "--json").stdout)["daemon"]["state"] == "running")

    (inbox / "essay.md").write_text("# An essay\n\n" + PARAGRAPH * 8)
    made = {}
    for case in HOSTILE:
        make = getattr(hostile_files, case)
        made[case] = make(inbox)
    huge = hostile_files.huge_file(inbox, 2**20)  # over max_mb: refused before it is even read
    (inbox / "note.txt").write_text(PARAGRAPH)
    assert wait_for(finished(daemon_home, 2 + len(HOSTILE)), timeout=180), daemon.output()

    second = npumoed("run", "--once")
    assert second.returncode == 1 and "already running" in second.stderr
    status = npumoed("status")
    assert daemon.process.poll() is None, daemon.output()
    assert stop(daemon) == 0

    by_name = {Path(j["path"]).name: j for j in jobs(daemon_home)}
    for name in ("essay.md", "note.txt"):
        assert by_name[name]["state"] == "done"
        assert_complete_outputs(by_name[name])
    for case, kind in HOSTILE.items():
        job = by_name[made[case].name]
        assert (job["state"], job["error_kind"]) == ("dead", kind), job
        failed = daemon_home / "failed" / Path(job["path"]).name
        assert failed.exists() and job["last_error"] in Path(f"{failed}.error.txt").read_text()
    assert "over the 0.5 MB limit" in (daemon_home / "failed" / f"{huge.name}.error.txt").read_text()
    assert huge.name not in by_name
    assert "npumoed running" in status.stdout and "dead (encrypted)" in status.stdout
    after = json.loads(npumoed("status", "--json").stdout)
    assert after["daemon"]["state"] == "stopped" and after["queue"]["done"] == 2


@pytest.mark.slow  # two lives of a real daemon (make chaos, which also kills workers hundreds of times)
def test_sigterm_mid_document_loses_nothing_and_a_restart_finishes_it(
    daemon_home: Path,
    start_npumoed: Callable[..., Any],
    npumoed: Callable[..., subprocess.CompletedProcess[str]],
    wait_for: Callable[..., bool],
) -> None:
    (daemon_home / "inbox" / "long.md").write_text("# A long one\n\n" + PARAGRAPH * 40)
    daemon = start_npumoed("run")
    assert wait_for(lambda: any(j["state"] == "running" and j["progress"] > 0 for j in jobs(daemon_home)), 120), (
        daemon.output()
    )
    assert stop(daemon) == 0, daemon.output()

    [job] = jobs(daemon_home)
    assert (job["state"], job["attempts"], job["last_error"]) == ("queued", 0, None)
    assert list((daemon_home / "outbox").iterdir()) == []  # no outputs, no temporaries

    again = npumoed("run", "--once")
    assert again.returncode == 0, again.stderr
    [job] = jobs(daemon_home)
    assert (job["state"], job["attempts"]) == ("done", 1)
    assert_complete_outputs(job)
    assert [p.name for p in (daemon_home / "outbox").iterdir()] == [Path(job["output_dir"]).name]


def test_run_once_on_a_folder_processes_a_multi_chunk_markdown_file_and_exits(
    daemon_home: Path, tmp_path: Path, npumoed: Callable[..., subprocess.CompletedProcess[str]]
) -> None:
    folder = tmp_path / "papers"
    folder.mkdir()
    (folder / "paper.md").write_text("# A paper\n\n" + PARAGRAPH * 10)
    result = npumoed("run", "--once", "--inbox", str(folder))
    assert result.returncode == 0, result.stderr
    assert "1 done" in result.stdout
    [job] = jobs(daemon_home)
    assert job["state"] == "done" and Path(job["output_dir"]).parent == daemon_home / "outbox"
    meta = json.loads((Path(job["output_dir"]) / "meta.json").read_text())
    assert meta["chunks"] > 1 and meta["extraction"]["format"] == "markdown"
    assert_complete_outputs(job)
