"""Keeping the computer awake while overnight batch work can run: a power assertion held by a child process.

    macOS: `caffeinate -i -w PID`: no idle sleep while this process lives.
    Linux: `systemd-inhibit --what=idle … cat`: logind's idle lock, held while `cat` reads the pipe we hold;
           the pipe closes when we exit, even by SIGKILL, so the lock never outlives the daemon.
    Elsewhere: nothing is held, and `status` says so.

Only idle sleep is held off: a person who closes the lid or chooses Sleep still gets it.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence

from ..scheduler import Decision

log = logging.getLogger(__name__)

STOP_SECONDS = 5.0  # how long a released assertion's process gets to end before it is killed


def windows_to_stay_awake_for(decision: Decision, running_window: str | None) -> tuple[str, ...]:
    """The open batch windows with work waiting in them (or running now) that may run: what to stay awake for."""
    if not decision.run:  # paused, on battery, …: staying awake would not get the work done
        return ()
    due = set(decision.batch_due)
    if running_window in decision.open_windows:
        due.add(running_window)
    return tuple(sorted(due))


def assertion_command(why: str, *, pid: int | None = None, platform: str = sys.platform,
                      which: Callable[[str], str | None] = shutil.which) -> list[str] | None:
    """The command that holds an idle-sleep assertion while it runs; None where there is none."""
    pid = os.getpid() if pid is None else pid
    if platform == "darwin" and which("caffeinate"):
        return ["caffeinate", "-i", "-w", str(pid)]
    if platform.startswith("linux") and which("systemd-inhibit"):
        return ["systemd-inhibit", "--what=idle", "--mode=block", "--who=npumoed", f"--why={why}", "cat"]
    return None


class PowerAssertion:
    """At most one assertion at a time, started by `hold` and ended by `release`; `holding` says what for."""

    def __init__(self, command: Callable[[str], Sequence[str] | None] = assertion_command,
                 spawn: Callable[..., subprocess.Popen[bytes]] = subprocess.Popen) -> None:
        self.command = command
        self.spawn = spawn
        self.holding = ""  # "" or the reason, e.g. "batch window 01:00-06:00 (caffeinate)"
        self._process: subprocess.Popen[bytes] | None = None
        self._why = ""  # what the running process holds the assertion for
        self._failed = ""  # the reason an assertion could not be held for; not tried again until released

    def hold(self, why: str) -> None:
        """Hold an assertion for `why`, unless one is held for it already or it could not be held for it."""
        if self._process is not None and self._process.poll() is not None:
            log.warning("the power assertion (%s) ended by itself with status %d; the computer may sleep",
                        self.holding, self._process.returncode)
            self._failed, self._process, self.holding = self._why, None, ""
        held_for = self._why if self._process is not None else None
        if why in (held_for, self._failed):
            return
        self.release()
        command = self.command(why)
        if command is None:
            self._failed = why
            return
        try:
            self._process = self.spawn(list(command), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            log.warning("cannot keep the computer awake for %s: %s", why, e)
            self._failed = why
            return
        self._why, self.holding = why, f"{why} ({command[0]})"
        log.info("keeping the computer awake: %s", self.holding)

    def release(self) -> None:
        process, self._process, self._failed = self._process, None, ""
        if process is None:
            return
        log.info("no longer keeping the computer awake (%s)", self.holding)
        self.holding = ""
        if process.stdin is not None:
            process.stdin.close()  # `cat` ends here; caffeinate needs the signal
        process.terminate()
        try:
            process.wait(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
