"""Two homes (as two machines would have) on one PostgreSQL queue, through the real `npumoed` commands.

`npumoed add` on one machine queues a document by its path on the shared storage; the other machine's daemon
processes it into the shared outbox; `status --json` and `jobs` on the first machine show the other's worker
and where the outputs went.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.postgres_server import PostgresServer

TEXT = "The night clerk reads the harbour ledger and writes a short note on each page before the tide turns.\n"


def npumoed(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NPUMOED_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "npumoe.daemon", *args], env=env, capture_output=True, text=True,
                          timeout=300)


def machine(root: Path, name: str, url: str, shared: Path, model: Path) -> Path:
    """A home on `root` whose queue is at `url`, with the storage every machine mounts at `shared`."""
    home = root / name
    home.mkdir()
    (home / "config.toml").write_text(f"""
[model]
name = "{model}"
chunk_tokens = 64
summary_tokens = 2

[queue]
url = "{url}"
shared_folders = ["{shared}"]

[outbox]
folder = "{shared / 'outbox'}"

[scheduler]
max_foreground_load = 1.0

[cpu]
threads = 1
background_priority = false
""")
    return home


@pytest.mark.slow  # two real daemons on one PostgreSQL queue (make chaos, beside the several-machines run)
def test_a_document_added_on_one_machine_is_processed_by_another_into_the_shared_outbox(
    tmp_path: Path, postgres: PostgresServer, tiny_model: Path
) -> None:
    url, shared = postgres.new_database(), tmp_path / "shared"
    (shared / "documents").mkdir(parents=True)
    document = shared / "documents" / "ledger.txt"
    document.write_text(TEXT)
    laptop = machine(tmp_path, "laptop", url, shared, tiny_model)
    desktop = machine(tmp_path, "desktop", url, shared, tiny_model)

    added = npumoed(laptop, "add", "--json", str(document))
    assert added.returncode == 0, added.stderr
    [queued] = json.loads(added.stdout)["jobs"]
    assert queued["created"] and queued["pinned_host"] is None  # on the shared storage: any worker may take it

    ran = npumoed(desktop, "run", "--once")
    assert ran.returncode == 0, ran.stderr
    assert list((laptop / "outbox").iterdir()) == [] and list((desktop / "outbox").iterdir()) == []

    status = npumoed(laptop, "status", "--json")
    assert status.returncode == 0, status.stderr
    snap: dict[str, Any] = json.loads(status.stdout)
    assert snap["daemon"] == {"state": "never started"}  # the laptop's own daemon never ran
    [worker] = snap["workers"]
    assert (worker["home"], worker["state"], worker["done"]) == (str(desktop), "stopped", 1)
    [done] = snap["recent_done"]
    output = Path(done["output_dir"])
    assert output.parent == shared / "outbox" and (output / "summary.md").exists()

    jobs = json.loads(npumoed(laptop, "jobs", "--json").stdout)["jobs"]
    assert [(j["state"], j["worker_host"], j["output_dir"]) for j in jobs] == [("done", worker["host"], str(output))]
    table = npumoed(laptop, "jobs").stdout
    assert worker["host"] in table and "done" in table


def test_status_shows_every_worker_judging_other_hosts_by_their_heartbeat(postgres: PostgresServer) -> None:
    from npumoe.daemon.cli.status_view import STALE_SECONDS, render_text, snapshot
    from npumoe.jobs.queue.store import Queue

    url, now = postgres.new_database(), 1_800_000_000.0
    here, there = Queue(url, home="/home/me/npumoed"), Queue(url, host="attic-mac", home="/Users/a/npumoed")
    job, _ = there.add("/Volumes/archive/long.pdf", "f" * 64, model_key="m", settings_key="s")
    there.claim(4242, lease_seconds=600)
    there.heartbeat(job.id, 4242, lease_seconds=600, progress=0.5)
    # pid 4242 may not exist here: on another host only the heartbeat counts
    there.daemons.write(pid=4242, started_at=now - 600, heartbeat_at=now - 2, activity="working", current_job=job.id,
                       counters={"done": 7})
    here.daemons.write(pid=os.getpid(), started_at=now - 60, heartbeat_at=now - STALE_SECONDS - 5, activity="working",
                      counters={})
    snap = snapshot(here, now=now)
    workers = {w["host"]: w for w in snap["workers"]}
    assert (workers["attic-mac"]["state"], workers["attic-mac"]["job"]["progress"]) == ("running", 0.5)
    assert workers[here.host]["state"] == "not responding" and snap["daemon"]["pid"] == os.getpid()
    text = render_text(snap)
    assert "workers:" in text
    line = "attic-mac /Users/a/npumoed · pid 4242 · running · working · heartbeat 2s ago · #1 long.pdf 50% · 7 done"
    assert line in text
    there.daemons.write(heartbeat_at=now - STALE_SECONDS - 5)
    assert {w["host"]: w["state"] for w in snapshot(here, now=now)["workers"]}["attic-mac"] == "not responding"
    here.close()
    there.close()
