"""Logging for the daemon: a rotating file under the home's logs/ folder, and stderr when run by hand.

Under the service manager stderr is appended to a file that never rotates, so there the rotating file is the
only place a line goes.
"""

from __future__ import annotations

import logging
import os
import sys
from logging.handlers import RotatingFileHandler
from pathlib import Path

LOG_NAME = "npumoed.log"
FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
# Control characters spelled out, newlines included: tab is the only one a message keeps.
ESCAPES = {code: f"\\x{code:02x}" for code in (*range(32), 127) if code != 9} | {10: "\\n", 13: "\\r"}


class OneLineFormatter(logging.Formatter):
    """One record, one line: a file may be named with newlines (or terminal escapes), and such a name must
    neither break a log line nor forge one. Tracebacks, added after the message, keep their lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return super().formatMessage(record).translate(ESCAPES)


def setup_logging(logs: Path, *, verbose: bool = False, to_stderr: bool = True) -> Path:
    """Send the `npumoe` loggers to `logs/npumoed.log` (5 MB × 3, user-only), and to stderr unless told not to;
    returns the file."""
    path = logs / LOG_NAME
    old = os.umask(0o077)
    try:
        logs.mkdir(parents=True, exist_ok=True)
        to_file = RotatingFileHandler(path, maxBytes=5 * 2**20, backupCount=3, encoding="utf-8")
    finally:
        os.umask(old)
    handlers: list[logging.Handler] = [to_file, logging.StreamHandler(sys.stderr)] if to_stderr else [to_file]
    root = logging.getLogger("npumoe")
    for handler in list(root.handlers):  # set up twice in one process (the demo, tests): replace, not add
        root.removeHandler(handler)
        handler.close()
    for handler in handlers:
        handler.setFormatter(OneLineFormatter(FORMAT))
        root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    return path
