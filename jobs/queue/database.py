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
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.exc import DatabaseError, DBAPIError

from ..errors import DatabaseUnusable
from .dialects import open_dialect
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
    `host` and `home` say which daemon this is, for its row in the daemon table."""

    def __init__(self, location: Path | str, *, read_only: bool = False, host: str | None = None,
                 home: Path | str | None = None) -> None:
        self.dialect = open_dialect(location)
        self.path = getattr(self.dialect, "path", None)  # the SQLite file; None for a server
        self.location = str(location)
        self.host = host or socket.gethostname()
        self.home = str(home if home is not None else self.path.parent if self.path else "")
        self.writer, self.reader = self.dialect.engines(read_only=read_only)
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

    def close(self) -> None:
        for engine in (self.writer, self.reader):
            if engine is not None:
                engine.engine.dispose()
