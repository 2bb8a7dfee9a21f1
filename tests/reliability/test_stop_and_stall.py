"""The real daemon, stopped gracefully mid-document again and again, and hung in a prefill.

A stop (SIGTERM: logout, reboot, `launchctl stop`, `systemctl --user stop`) hands the running job back
within the service's stop timeout and never spends one of its attempts; a job whose prefill hangs is
stopped by the no-progress watchdog, recorded as stalled, and tried again.
"""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from home_audit import read_jobs
from sqlalchemy.exc import OperationalError

from npumoe.daemon.heartbeat import EXIT_STUCK
from npumoe.daemon.service import Service

HERE = Path(__file__).parent
PARAGRAPH = "Each ledger line is checked twice, once by the clerk and once by the auditor, before the close.\n\n"
STOPS = 3
STALL_SECONDS = 2


def jobs_now(home: Path) -> list[Any]:
    try:
        return read_jobs(home / "npumoed.db")
    except (FileNotFoundError, OperationalError):
        return []


def running_with_progress(home: Path) -> bool:
    return any(job.state == "running" and job.progress > 0 for job in jobs_now(home))


@pytest.mark.slow  # four lives of the daemon: `make chaos` runs it
def test_sigterm_mid_document_again_and_again_never_spends_an_attempt(
    home: Path, daemon_config: Callable[..., Path], start_npumoed: Callable[..., Any],
    npumoed: Callable[..., subprocess.CompletedProcess[str]], wait_for: Callable[..., bool],
) -> None:
    daemon_config(max_attempts=2)  # fewer attempts than stops: any stop that cost one would kill the job
    (home / "inbox").mkdir(parents=True)
    (home / "inbox" / "ledger.md").write_text("# Ledger\n\n" + PARAGRAPH * 120)
    stop_timeout = next(f.default for f in dataclasses.fields(Service) if f.name == "stop_timeout_seconds")
    for stop in range(STOPS):
        daemon = start_npumoed("run")
        assert wait_for(lambda: running_with_progress(home), timeout=180, interval=0.05), daemon.output()
        daemon.process.send_signal(signal.SIGTERM)
        assert daemon.process.wait(timeout=stop_timeout) == 0, daemon.output()  # before the service's SIGKILL
        [job] = jobs_now(home)
        assert (job.state, job.attempts, job.last_error) == ("queued", 0, None), f"stop {stop + 1}"
    finished = npumoed("run", "--once", timeout=600)
    assert finished.returncode == 0, finished.stderr
    [job] = jobs_now(home)
    assert (job.state, job.attempts) == ("done", 1)


@pytest.mark.slow  # waits out the stall watchdog in real time (make chaos)
def test_a_hung_prefill_is_stopped_recorded_and_tried_again(
    home: Path, tmp_path: Path, daemon_config: Callable[..., Path],
    npumoed: Callable[..., subprocess.CompletedProcess[str]], wait_for: Callable[..., bool],
) -> None:
    config = daemon_config()
    config.write_text(config.read_text().replace("[queue]\n", f"[queue]\nstall_seconds = {STALL_SECONDS}\n"))
    (home / "inbox").mkdir(parents=True)
    (home / "inbox" / "ledger.md").write_text("# Ledger\n\n" + PARAGRAPH * 20)
    marker = tmp_path / "hung-once"
    started = time.monotonic()
    hung = subprocess.run([sys.executable, str(HERE / "hanging_npumoed.py"), str(marker), "run"],
                          capture_output=True, text=True, timeout=180)
    assert marker.exists(), hung.stderr  # the injected hang was reached
    assert hung.returncode == EXIT_STUCK, hung.stderr
    assert time.monotonic() - started < 120
    [job] = jobs_now(home)
    assert (job.state, job.error_kind, job.attempts) == ("failed", "stalled", 1)
    assert "no progress for" in (job.last_error or "") and "prefill" in (job.last_error or "")
    assert wait_for(lambda: jobs_now(home)[0].run_after < time.time(), timeout=30)  # its retry backoff
    again = npumoed("run", "--once")  # what the service manager's restart does
    assert again.returncode == 0, again.stderr
    [job] = jobs_now(home)
    assert (job.state, job.attempts) == ("done", 2)
