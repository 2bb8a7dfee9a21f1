"""The queue's database, opened once and shared by every part of the queue: jobs (store.py), the inbox files
already handed on (handed.py), the daemons' rows (daemons.py) and the person's switches (controls.py).

Opening checks the library and the file and migrates the schema; every write runs in one transaction
(`tx`), every read on a connection of its own (`read`).
"""

from __future__ import annotations

import functools
import logging
import socket
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from pathlib import Path
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.exc import DatabaseError, DBAPIError

from ..errors import DatabaseUnusable, IdentityInUse
from .dialects import open_dialect
from .identity import IDENTITY_FILE, machine_identity
from .schema import migrate

log = logging.getLogger(__name__)

DAMAGED = ("SQLITE_CORRUPT", "SQLITE_NOTADB")  # "database disk image is malformed", "file is not a database"


def damage(error: DatabaseError) -> DatabaseUnusable | None:
    """The error as DatabaseUnusable when SQLite found the file damaged; None for any other database error."""
    if getattr(error.orig, "sqlite_errorname", "") in DAMAGED:
        return DatabaseUnusable(f"the database is damaged ({error.orig})")
    return None


def reconnecting(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run a queue operation once more when the server dropped the connection under it (a restart): the
    transaction was rolled back, or, had it committed, the second run finds the work done and says so."""

    @functools.wraps(method)
    def run(self: object, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except DBAPIError as e:
            if not e.connection_invalidated:
                raise
            log.warning("the queue server dropped the connection during %s (%s); trying again",
                        method.__name__, str(e.orig).strip())
            return method(self, *args, **kwargs)

    return run


class Database:
    """`location` is a SQLite file, or a `postgresql://…` URL for a queue that several machines share.
    `host` and `home` say which daemon this is, for its row in the daemon table: on a shared queue `host` is
    by default the home's machine identity (identity.py), which neither repeats nor changes; a home's own
    file has one worker, whose host name only labels its rows, as it does a home given only as a name."""

    def __init__(self, location: Path | str, *, read_only: bool = False, host: str | None = None,
                 home: Path | str | None = None) -> None:
        self.dialect = open_dialect(location)
        self.path = getattr(self.dialect, "path", None)  # the SQLite file; None for a server
        self.location = str(location)
        self.home = str(home if home is not None else self.path.parent if self.path else "")
        has_home = bool(self.home) and Path(self.home).is_dir()  # not "", which is the working folder
        self.host = host or (machine_identity(Path(self.home)) if self.dialect.shared and has_home
                             else socket.gethostname())
        self.writer, self.reader = self.dialect.engines(read_only=read_only)
        self._identity_held: Connection | None = None
        if read_only:
            return
        try:
            with self.tx() as conn:
                self.dialect.check(conn)  # SQLite: a recent enough library and a sound file
                migrate(conn)
        except DatabaseError as e:
            self.close()
            if problem := damage(e):
                raise problem from e
            raise
        except DatabaseUnusable:
            self.close()
            raise

    @property
    def shared(self) -> bool:
        """Whether workers of other homes and machines may share this queue (PostgreSQL)."""
        return self.dialect.shared

    @contextmanager
    def tx(self) -> Iterator[Connection]:
        if self.writer is None:
            raise PermissionError("this queue was opened read-only")
        with self.writer.begin() as conn:
            yield conn

    def read(self) -> AbstractContextManager[Connection]:
        return self.reader.connect()

    def hold_identity(self) -> None:
        """Hold, while this database stays open, the mark that a daemon of this identity and home is alive;
        IdentityInUse while another process holds it (a home copied, identity and all, to another machine).
        What only a daemon does on a shared queue (reap, claim, write its row) takes it first. A home's own
        file needs none: its lock says the same, and neither does a queue opened with no home (a benchmark's
        workers, a test's): only a home has an identity. A killed daemon's mark goes with its connection."""
        if self._identity_held is not None or not self.dialect.shared or not self.home:
            return
        conn = self.writer.connect()  # kept out of the pool: the mark lives as long as this connection
        if not self.dialect.try_hold(conn, f"{self.host}\0{self.home}"):
            conn.close()
            raise IdentityInUse(f"a live npumoed on this queue is already known as {self.host!r} with the home "
                                f"{self.home}: this home was copied from another machine, its identity too; "
                                f"delete {Path(self.home) / IDENTITY_FILE} here to give this one its own")
        self._identity_held = conn

    def close(self) -> None:
        if self._identity_held is not None:
            with suppress(DBAPIError):  # a lost connection took its locks with it
                self.dialect.let_go(self._identity_held)
            self._identity_held.close()
            self._identity_held = None
        for engine in (self.writer, self.reader):
            if engine is not None:
                engine.engine.dispose()
