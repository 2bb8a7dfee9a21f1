"""Document text extraction, isolated: each parse runs in a child process with time, memory and size limits.

The parent watches the child (psutil) and stops it over a limit: its resident memory over `memory_mb` (the
child's RLIMIT_AS cap acts first where the system enforces it; macOS does not), its processor time over
`timeout_s` (a busy machine, or the idle scheduling class the daemon runs in, slows the clock, not the work),
or ten times that spent not running at all (a child that hangs). Of its stderr only the tail is kept.

The parent opens the file itself (`open_regular`: never following a symlink, never blocking on a FIFO,
refusing anything but a regular file) and hands the child that open descriptor, so the child reads exactly
the file that was checked even if the path is renamed, replaced or deleted meanwhile. Every failure is an
ExtractionError with a kind, except a parser library that will not import (MissingDependency: the machine's
fault, not the document's).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

import psutil

from ..errors import ExtractionError, MissingDependency
from ..files import open_regular, real_folder
from .formats import FORMATS, ExtractedText, ExtractLimits, sniff_format

__all__ = ["FORMATS", "ExtractLimits", "ExtractedText", "detect_format", "extract_text"]

DEFAULT_LIMITS = ExtractLimits()
# -I: the child imports only from the installed packages, never from its working directory (a `json.py` in the
# inbox), PYTHONPATH or the user's site-packages; it is started in a private empty folder of its own as well.
CHILD_COMMAND = [sys.executable, "-I", "-m", "npumoe.jobs.extract.child"]
POLL_S = 0.05  # how often the parent looks at its child's memory and time
STDERR_TAIL_BYTES = 64 * 2**10  # what is kept of the child's stderr: its last lines say how it died
WAIT_FACTOR = 10  # a child that has not run for ten times its time limit is stuck, not slow


def detect_format(path: Path) -> str:
    """One of FORMATS, judged by the file's content; its extension only breaks ties (text vs Markdown)."""
    with open_regular(real_folder(Path(path)), empty=False) as file:
        return sniff_format(file, Path(path).suffix)


def extract_text(path: Path, limits: ExtractLimits = DEFAULT_LIMITS) -> ExtractedText:
    """The document's plain text, parsed in a child process; raises ExtractionError saying why not, or
    MissingDependency when this machine lacks a package the parser needs."""
    path = Path(path)
    # The folder resolved: what is parsed is the pipeline's private copy, in the daemon's own folder.
    with open_regular(real_folder(path), limits.max_bytes, empty=False) as file:  # FileRefused says why not
        reply = _run_child(file.fileno(), path.suffix, limits)
    if "kind" in reply:
        raise ExtractionError(reply["kind"], reply["message"])
    if "missing_dependency" in reply:
        raise MissingDependency(reply["missing_dependency"], reply["module"])
    return ExtractedText(**reply)


def _run_child(fd: int, suffix: str, limits: ExtractLimits) -> dict[str, Any]:
    request = json.dumps({"fd": fd, "suffix": suffix, "limits": asdict(limits)}).encode()
    # Leaving the with-block waits for the child, so a killed child is always reaped: no zombies.
    with tempfile.TemporaryDirectory(prefix="npumoed-extract-") as cwd, subprocess.Popen(
        CHILD_COMMAND, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(fd,), cwd=cwd
    ) as child:
        try:
            out, err = _supervise(child, request, limits)
        except BaseException:
            child.kill()
            raise
    if child.returncode == 0:
        try:
            return json.loads(out)
        except ValueError:
            pass
    raise child_failure(child.returncode, err)


def _supervise(child: subprocess.Popen[bytes], request: bytes, limits: ExtractLimits) -> tuple[bytes, bytes]:
    """Hand the child its request; return its stdout and the tail of its stderr once it has exited. Raises
    ExtractionError as soon as it goes over a limit (the caller kills it)."""
    assert child.stdin and child.stdout and child.stderr
    try:
        child.stdin.write(request)
        child.stdin.close()
    except BrokenPipeError:  # it died at once: how, its exit status says
        pass
    watch = _Watch(psutil.Process(child.pid), limits)
    out, err = bytearray(), bytearray()
    with selectors.DefaultSelector() as selector:
        selector.register(child.stdout, selectors.EVENT_READ, out)
        selector.register(child.stderr, selectors.EVENT_READ, err)
        while True:
            if selector.get_map():
                for key, _ in selector.select(POLL_S):
                    _read_into(selector, key.fileobj, key.data)  # type: ignore[arg-type]
                del err[:-STDERR_TAIL_BYTES]
            else:  # both closed: it is exiting, or hangs after closing them
                try:
                    child.wait(POLL_S)
                    return bytes(out), bytes(err)
                except subprocess.TimeoutExpired:
                    pass
            if (over := watch.over()) is not None:
                raise over


def _read_into(selector: selectors.BaseSelector, pipe: IO[bytes], buffer: bytearray) -> None:
    if chunk := os.read(pipe.fileno(), 1 << 16):
        buffer += chunk
    else:
        selector.unregister(pipe)


class _Watch:
    """The child's memory and time as the parent sees them, which holds on every system."""

    def __init__(self, process: psutil.Process, limits: ExtractLimits) -> None:
        self.process, self.limits = process, limits
        self.waited_s, self.since = 0.0, time.monotonic()

    def over(self) -> ExtractionError | None:
        """The limit the child is over, in words; None while it is within them all (or has just exited)."""
        now = time.monotonic()
        elapsed, self.since = now - self.since, now
        try:
            with self.process.oneshot():
                resident = self.process.memory_info().rss
                times = self.process.cpu_times()
                runs = self.process.status() == psutil.STATUS_RUNNING  # on a processor, or waiting for one
        except psutil.NoSuchProcess:
            return None
        limits = self.limits
        if resident > limits.memory_mb * 2**20:
            return ExtractionError("memory", f"extraction used more than {limits.memory_mb} MiB of memory and was "
                                             "stopped (extract.memory_mb)")
        if times.user + times.system > limits.timeout_s:
            return ExtractionError("timeout", f"extraction used more than {limits.timeout_s:g} s of processor time "
                                              "and was stopped")
        self.waited_s += 0.0 if runs else elapsed
        if self.waited_s > WAIT_FACTOR * limits.timeout_s:
            return ExtractionError("timeout", f"extraction waited {WAIT_FACTOR * limits.timeout_s:g} s without "
                                              "running and was stopped")
        return None


def child_failure(returncode: int, stderr: bytes) -> ExtractionError:
    """Classify an extraction child that died without a reply (it only ever dies of memory or of a bug)."""
    lines = stderr.decode("utf-8", errors="replace").strip().splitlines()
    if returncode < 0:
        try:
            detail = f"killed by {signal.Signals(-returncode).name}"
        except ValueError:  # a real-time signal has no name
            detail = f"killed by signal {-returncode}"
    else:
        detail = f"exit status {returncode}" + (f": {lines[-1]}" if lines else "")
    # Our own timeout is handled before this; any other SIGKILL is the kernel's out-of-memory killer.
    if returncode == -signal.SIGKILL or any("MemoryError" in line for line in lines[-3:]):
        return ExtractionError("memory", f"extraction ran out of memory ({detail})")
    return ExtractionError("corrupt", f"the parser crashed on this document ({detail})")
