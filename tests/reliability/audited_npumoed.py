"""Run `npumoed` under an audit hook that records what it reads, writes and connects to.

    python audited_npumoed.py RECORD.jsonl npumoed-arguments…     (or, from a test: `run_audited`)

Each file-system or network audit event (PEP 578) raised in the daemon's process becomes one JSON line in
RECORD: {"event", "path", "real", "write"} for files, where "real" is the path with its symlinks resolved the
way the operation would resolve them (an open with O_NOFOLLOW does not follow the last component), and
{"event", "address"} for sockets. The extraction child is another interpreter and records nothing, but it
only ever reads the open descriptor the daemon hands it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
READS = {"open", "os.listdir", "os.scandir"}
# event -> (positions of its path arguments, positions of its dir_fd arguments)
WRITES = {
    "os.rename": ((0, 1), (2, 3)),
    "os.link": ((0, 1), (2, 3)),
    "os.symlink": ((1,), (2,)),
    "os.mkdir": ((0,), (2,)),
    "os.remove": ((0,), (1,)),
    "os.rmdir": ((0,), (1,)),
    "os.chmod": ((0,), (2,)),
    "os.chown": ((0,), (3,)),
    "os.utime": ((0,), (3,)),
    "os.truncate": ((0,), ()),
    "shutil.rmtree": ((0,), (1,)),
}
NETWORK = {"socket.connect", "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyname_ex",
           "socket.sendto", "socket.sendmsg"}


def resolve(path: Any, *, follow_last: bool = True) -> tuple[str, str] | None:
    """(absolute path, real path) of a path argument; None for descriptors and dir_fd-relative names."""
    if not isinstance(path, str | bytes | os.PathLike):
        return None
    absolute = os.path.abspath(os.fsdecode(path))
    if follow_last:
        return absolute, os.path.realpath(absolute)
    return absolute, os.path.join(os.path.realpath(os.path.dirname(absolute)), os.path.basename(absolute))


def describe(event: str, args: tuple[Any, ...]) -> list[dict[str, Any]]:
    if event in NETWORK:
        return [{"event": event, "address": repr(args[1] if event.startswith("socket.send") else args[-1]
                                                  if event == "socket.connect" else args[:2])}]
    if event == "open":
        path, mode, flags = args
        write = bool(flags & WRITE_FLAGS) if mode is None else any(c in str(mode) for c in "wax+")
        paths = [resolve(path, follow_last=not flags & os.O_NOFOLLOW)]
    elif event in READS:
        write, paths = False, [resolve(args[0])]
    elif event in WRITES:
        names, dir_fds = WRITES[event]
        if any(args[i] not in (None, -1, -100) for i in dir_fds if i < len(args)):  # -1: none, -100: AT_FDCWD
            return []  # a name inside a folder opened earlier, e.g. by rmtree, whose own event was recorded
        write, paths = True, [resolve(args[i], follow_last=False) for i in names]
    else:
        return []
    return [{"event": event, "path": p[0], "real": p[1], "write": write} for p in paths if p is not None]


def run_audited(args: Sequence[str], *, home: Path, record: Path, prefix: Sequence[str] = (),
                timeout: float = 600) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    """Run `npumoed ARGS` on `home` under the audit hook, with the usual umask of 022 (so nothing private
    comes out private by accident); returns the finished process and the recorded events."""
    env = {**os.environ, "NPUMOED_HOME": str(home)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # torch in the test process sets it: the daemon's own choice is tested
    process = subprocess.run([*prefix, sys.executable, __file__, str(record), *args],
                             env=env, capture_output=True, text=True, timeout=timeout, umask=0o022)
    return process, [json.loads(line) for line in record.read_text().splitlines()]


def main() -> None:
    record = open(sys.argv[1], "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (open for the whole run)
    lock = threading.Lock()

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event in READS or event in WRITES or event in NETWORK:
            lines = describe(event, args)
            with lock:
                for line in lines:
                    record.write(json.dumps(line) + "\n")

    sys.addaudithook(hook)
    sys.argv = ["npumoed", *sys.argv[2:]]
    from npumoe.daemon.cli import main as npumoed

    npumoed()


if __name__ == "__main__":
    main()
