"""Document text extraction, isolated: each parse runs in a child process with time, memory and size limits.

The parent opens the file itself (`open_regular`: never following a symlink, never blocking on a FIFO,
refusing anything but a regular file) and hands the child that open descriptor, so the child reads exactly
the file that was checked even if the path is renamed, replaced or deleted meanwhile. Every failure is an
ExtractionError with a kind, except a parser library that will not import (MissingDependency: the machine's
fault, not the document's).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..errors import ExtractionError, MissingDependency
from ..files import open_regular
from .formats import FORMATS, ExtractedText, ExtractLimits, sniff_format

__all__ = ["FORMATS", "ExtractLimits", "ExtractedText", "detect_format", "extract_text"]

DEFAULT_LIMITS = ExtractLimits()
_CHILD = [sys.executable, "-m", "npumoe.jobs.extract.child"]


def detect_format(path: Path) -> str:
    """One of FORMATS, judged by the file's content; its extension only breaks ties (text vs Markdown)."""
    with open_regular(Path(path), empty=False) as file:
        return sniff_format(file, Path(path).suffix)


def extract_text(path: Path, limits: ExtractLimits = DEFAULT_LIMITS) -> ExtractedText:
    """The document's plain text, parsed in a child process; raises ExtractionError saying why not, or
    MissingDependency when this machine lacks a package the parser needs."""
    path = Path(path)
    with open_regular(path, limits.max_bytes, empty=False) as file:  # FileRefused says why not
        reply = _run_child(file.fileno(), path.suffix, limits)
    if "kind" in reply:
        raise ExtractionError(reply["kind"], reply["message"])
    if "missing_dependency" in reply:
        raise MissingDependency(reply["missing_dependency"], reply["module"])
    return ExtractedText(**reply)


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
