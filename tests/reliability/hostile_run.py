"""One real daemon run over an inbox holding every hostile input, recorded for the tests to judge.

The inbox gets every case of `hostile_files.make_all`, a symlink and a symlinked folder pointing at a secret
outside it, names built to look like options or parent folders, and two documents queued by hand (`npumoed
add`) and then deleted or rewritten before the daemon reads them. Then one `npumoed run --once` takes it all,
under the audit hook of audited_npumoed.py and with a umask of 022.

As root, the daemon runs with CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH dropped (setpriv), so a mode-000 file
is really unreadable to it; `unreadable_enforced` says whether that could be arranged.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from audited_npumoed import run_audited
from daemon_toml import daemon_toml
from home_audit import read_jobs
from support import hostile_files

from npumoe.jobs.queue.store import Job

SECRET = "the secret that lives outside every inbox"
ESCAPING_NAMES = ("up..\\..\\escape.md", "-rf --no-preserve-root.txt")
FORGED_LOG_LINE = "2001-01-01 00:00:00,000 INFO    npumoe.daemon.worker: job 999 done"
FORGING_NAME = f"note\n{FORGED_LOG_LINE}\r.txt"  # a name that would write a line of its own into the log


@dataclass
class HostileRun:
    home: Path
    outside: Path  # holds the secret; nothing in it may be read
    made: dict[str, Path]  # hostile case -> its path in the inbox
    escaping: dict[str, Path]  # ESCAPING_NAMES -> path
    queued_by_hand: dict[str, str]  # "deleted" / "changed" -> the sha256 that was queued
    process: subprocess.CompletedProcess[str]
    events: list[dict[str, Any]]
    jobs: list[Job]
    unreadable_enforced: bool

    def job_for(self, path: Path) -> Job:
        """The job of the file at `path` (the one for its current content, when it was rewritten)."""
        [job] = [job for job in self.jobs if job.path == os.path.normpath(path) and job.error_kind != "changed"]
        return job


def file_access_dropped() -> list[str]:
    """A command prefix that takes root's licence to read any file away; empty when not root or not possible."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return []
    prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]
    return prefix if subprocess.run([*prefix, "true"], capture_output=True).returncode == 0 else []


def can_read(prefix: list[str], path: Path) -> bool:
    probe = "import os, sys; sys.exit(0 if os.access(sys.argv[1], os.R_OK) else 1)"
    return subprocess.run([*prefix, sys.executable, "-c", probe, str(path)]).returncode == 0


def hostile_run(root: Path, model: Path) -> HostileRun:
    home, outside = root / "home", root / "outside"
    inbox = home / "inbox"
    inbox.mkdir(parents=True)
    (outside / "folder").mkdir(parents=True)
    (outside / "secret.txt").write_text(SECRET)
    (outside / "folder" / "private.md").write_text(f"# Private\n\n{SECRET}, in a folder.\n")
    (home / "config.toml").write_text(
        daemon_toml(f'name = "{model}"\nchunk_tokens = 64\nsummary_tokens = 4', originals="move"))

    made = hostile_files.make_all(inbox)
    for case in ("name_with_newline", "name_with_dotdot", "unreadable_file", "name_with_unicode"):
        with open(made[case], "a") as f:  # they share one sentence: give each content of its own
            f.write(f"\nThis copy is the {case.replace('_', ' ')} case.\n")
    (inbox / "secret-link.txt").symlink_to(outside / "secret.txt")
    (inbox / "linked-folder").symlink_to(outside / "folder", target_is_directory=True)
    escaping = {name: inbox / name for name in (*ESCAPING_NAMES, FORGING_NAME)}
    for name, path in escaping.items():
        path.write_text(f"A document called {name!r}, which must stay a plain name.\n")

    queued_by_hand = {}
    for label in ("deleted", "changed"):
        path = inbox / f"seen-then-{label}.txt"
        path.write_text(f"This document will be {label} after it was queued.\n")
        queued_by_hand[label] = hashlib.sha256(path.read_bytes()).hexdigest()
        added = subprocess.run([sys.executable, "-m", "npumoe.daemon", "add", str(path)], capture_output=True,
                               text=True, timeout=120, env={**os.environ, "NPUMOED_HOME": str(home)})
        assert added.returncode == 0, added.stderr
    (inbox / "seen-then-deleted.txt").unlink()
    (inbox / "seen-then-changed.txt").write_text("Rewritten after it was queued: new content, a new job.\n")

    prefix = file_access_dropped()
    process, events = run_audited(["run", "--once"], home=home, record=root / "audit.jsonl", prefix=prefix)
    return HostileRun(home, outside, made, escaping, queued_by_hand, process, events,
                      read_jobs(home / "npumoed.db"), not can_read(prefix, made["unreadable_file"]))
