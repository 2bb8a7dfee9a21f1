"""Document text extraction, isolated: each parse runs in a child process with time, memory and size limits.

The parent opens the file itself (never following a symlink, never blocking on a FIFO, refusing anything but a
regular file) and hands the child that open descriptor, so the child reads exactly the file that was checked
even if the path is renamed, replaced or deleted meanwhile. Every failure is an ExtractionError with a kind.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from npumoe.jobs.extract_formats import (
    FORMATS,
    KINDS,
    ExtractedText,
    ExtractionError,
    ExtractLimits,
    sniff_format,
)

__all__ = [
    "FORMATS",
    "KINDS",
    "ExtractLimits",
    "ExtractedText",
    "ExtractionError",
    "detect_format",
    "extract_text",
]

DEFAULT_LIMITS = ExtractLimits()
_CHILD = [sys.executable, "-m", "npumoe.jobs.extract_child"]
_FILE_TYPES = {
    stat.S_IFLNK: "a symbolic link (not followed)",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFDIR: "a directory",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def detect_format(path: Path) -> str:
    """One of FORMATS, judged by the file's content; its extension only breaks ties (text vs Markdown)."""
    fd, _ = _open_document(Path(path))
    with os.fdopen(fd, "rb") as file:
        return sniff_format(file, Path(path).suffix)


def extract_text(path: Path, limits: ExtractLimits = DEFAULT_LIMITS) -> ExtractedText:
    """The document's plain text, parsed in a child process; raises ExtractionError saying why not."""
    path = Path(path)
    fd, size = _open_document(path)
    try:
        if size > limits.max_bytes:
            raise ExtractionError("too_large", f"file is {size:,} bytes, over the {limits.max_bytes:,} limit")
        reply = _run_child(fd, path.suffix, limits)
    finally:
        os.close(fd)
    if "kind" in reply:
        raise ExtractionError(reply["kind"], reply["message"])
    return ExtractedText(**reply)


def _open_document(path: Path) -> tuple[int, int]:
    """An open descriptor on the regular, non-empty file at `path`, and its size."""
    try:
        # lstat first, so a FIFO or device is never even opened; O_NOFOLLOW and fstat close the race.
        _require_regular(path.lstat())
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ExtractionError("unreadable", "file no longer exists") from None
    except PermissionError:
        raise ExtractionError("unreadable", "permission denied") from None
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.EMLINK):  # what O_NOFOLLOW gives on Linux / on BSD
            raise ExtractionError("unreadable", f"file is {_FILE_TYPES[stat.S_IFLNK]}") from None
        raise ExtractionError("unreadable", f"cannot open file: {err.strerror}") from None
    try:
        status = os.fstat(fd)
        _require_regular(status)
        if status.st_size == 0:
            raise ExtractionError("empty", "file is empty (0 bytes)")
    except BaseException:
        os.close(fd)
        raise
    return fd, status.st_size


def _require_regular(status: os.stat_result) -> None:
    if not stat.S_ISREG(status.st_mode):
        what = _FILE_TYPES.get(stat.S_IFMT(status.st_mode), "not a regular file")
        raise ExtractionError("unreadable", f"file is {what}, not a regular file")


def _run_child(fd: int, suffix: str, limits: ExtractLimits) -> dict[str, Any]:
    request = json.dumps({"fd": fd, "suffix": suffix, "limits": asdict(limits)}).encode()
    # Leaving the with-block waits for the child, so a killed child is always reaped: no zombies.
    with subprocess.Popen(
        _CHILD, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(fd,)
    ) as child:
        try:
            out, err = child.communicate(request, timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
            raise ExtractionError(
                "timeout", f"extraction took longer than {limits.timeout_s:g} s and was stopped"
            ) from None
        except BaseException:
            child.kill()
            raise
    if child.returncode == 0:
        try:
            return json.loads(out)
        except ValueError:
            pass
    raise child_failure(child.returncode, err)


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
