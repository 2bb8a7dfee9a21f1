"""A throwaway PostgreSQL server for the tests, from the binaries the `pgserver` wheel ships.

Nothing is installed by hand: `pip install -e '.[dev]'` brings the server along. The server listens on a
Unix socket in its own temporary folder (no port to collide with another test run), with fsync off (the
tests check the queue's logic, not the disk's). PostgreSQL refuses to run as root, so as root (CI
containers) the server runs as the `nobody` account; its folder is handed to that account and nothing else
on the machine changes (pgserver's own launcher would create a system user and open up parent folders).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any


@functools.cache  # asked at first use, not import: where pgserver has no wheel (arm64 Linux) the rest still runs
def _binaries() -> Path:
    """The wheel's bin folder, found without importing pgserver (its import sets up a launcher we do not use)."""
    spec = importlib.util.find_spec("pgserver")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the PostgreSQL tests need the `pgserver` package: pip install -e '.[dev]'")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


SUPERUSER = "postgres"


def _as_server_account() -> dict[str, Any]:
    """subprocess arguments that run a command as the account the server may run as."""
    if os.geteuid() != 0:
        return {}
    nobody = pwd.getpwnam("nobody")
    return {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []}


@dataclass
class PostgresServer:
    root: Path
    _numbers: count = field(default_factory=lambda: count(1))

    @property
    def data(self) -> Path:
        return self.root / "data"

    @classmethod
    def start_new(cls) -> PostgresServer:
        root = Path(tempfile.mkdtemp(prefix="npumoed-pg-", dir="/tmp"))  # short: a socket path has ~100 bytes
        account = _as_server_account()
        if account:
            os.chown(root, account["user"], account["group"])
        server = cls(root)
        server._pg("initdb", "-D", str(server.data), "-U", SUPERUSER, "--auth=trust", "-E", "UTF8", "--no-sync")
        server.start()
        return server

    def _pg(self, program: str, *args: str) -> None:
        subprocess.run([str(_binaries() / program), *args], check=True, capture_output=True, text=True, timeout=120,
                       **_as_server_account())

    def start(self) -> None:
        options = f"-h '' -k {self.root} -c fsync=off -c synchronous_commit=off -c max_connections=200"
        self._pg("pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-w", "-o", options, "start")

    def stop(self) -> None:
        """A fast shutdown: open sessions are terminated, as when an administrator restarts the server."""
        self._pg("pg_ctl", "-D", str(self.data), "-w", "-m", "fast", "stop")

    def restart(self, down_seconds: float = 0.0) -> None:
        self.stop()
        time.sleep(down_seconds)
        self.start()

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@/{database}?host={self.root}"

    def new_database(self) -> str:
        """A fresh, empty database; returns its URL."""
        name = f"test_{os.getpid()}_{next(self._numbers)}"
        psql = [str(_binaries() / "psql"), "-q", "-v", "ON_ERROR_STOP=1", self.url(), "-c", f"CREATE DATABASE {name}"]
        subprocess.run(psql, check=True, capture_output=True, text=True, timeout=60)
        return self.url(name)

    def close(self) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
