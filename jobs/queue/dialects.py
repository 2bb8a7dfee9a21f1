"""What differs between the queue on SQLite and on PostgreSQL, side by side.

Everything else (the tables, the states, every query) is one piece of SQLAlchemy code for both. The
differences are few: how to connect, how an insert skips a duplicate, where the schema version is kept
and how two starting daemons keep from migrating at once, and wake-ups (PostgreSQL's NOTIFY reaches
workers on other machines; on SQLite there is one worker, woken by its own watcher).

Claims need no dialect code: the claim's subquery asks `FOR UPDATE SKIP LOCKED`, which PostgreSQL obeys
(two machines never wait on, or take, the same row) and SQLite's compiler leaves out (its `BEGIN
IMMEDIATE` already serialises writers).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from sqlalchemy import Connection, Engine, Insert, Table, create_engine, event
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, make_url
from sqlalchemy.pool import QueuePool

from ..errors import DatabaseUnusable
from . import sqlite as sqlite_driver

log = logging.getLogger(__name__)

CHANNEL = "npumoed_jobs"  # NOTIFY channel: a job became claimable
SCHEMA_LOCK = 0x6E70756D6F6564  # advisory lock key ("npumoed") held while one daemon migrates
MIN_SQLITE = (3, 35, 0)  # UPDATE … RETURNING
RECONNECT_SECONDS = 60.0  # how long a worker keeps trying to reach a restarting server before it gives up


def check_sqlite_version(version: tuple[int, int, int] | None = None) -> None:
    """The SQLite library (sqlean's own build, by default) is new enough for the queue's statements."""
    version = version or sqlite_driver.driver.sqlite_version_info
    if version < MIN_SQLITE:
        raise DatabaseUnusable(f"SQLite {'.'.join(map(str, version))} is too old: npumoed needs "
                               f"{'.'.join(map(str, MIN_SQLITE))} or newer")


def check_integrity(conn: Connection) -> None:
    """SQLite's quick_check: the pages and indexes are sound (it skips the slower cross-checks of integrity_check)."""
    problems = [" ".join(row[0].split()) for row in conn.exec_driver_sql("PRAGMA quick_check").all()]
    if problems != ["ok"]:
        raise DatabaseUnusable(f"the database is damaged (quick_check: {'; '.join(problems[:3])})")


def is_url(location: str | Path) -> bool:
    return isinstance(location, str) and "://" in location


class SQLite:
    """One home's database file: its lock holder is the only worker there is."""

    name: ClassVar[str] = "sqlite"
    shared: ClassVar[bool] = False

    def __init__(self, path: Path) -> None:
        self.path = path

    def engines(self, *, read_only: bool) -> tuple[Engine | None, Engine]:
        """(writer, reader): the writer's transactions begin IMMEDIATE; None for a read-only queue."""
        if read_only:
            if not self.path.exists():
                raise FileNotFoundError(f"no queue database at {self.path}")
            return None, self._engine(immediate=False, read_only=True)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.path.exists():
            self.path.touch(mode=0o600)
        return self._engine(immediate=True), self._engine(immediate=False)

    def _engine(self, *, immediate: bool, read_only: bool = False) -> Engine:
        uri = sqlite_driver.uri(self.path, read_only=read_only)

        def connect() -> Any:
            return sqlite_driver.driver.connect(uri, uri=True, timeout=30, check_same_thread=False)

        # Pooled, not reopened per statement: closing SQLite's last connection checkpoints the WAL and removes
        # its files, so a daemon that only reads would still write to disk every few seconds.
        engine = create_engine("sqlite://", creator=connect, module=sqlite_driver.driver, poolclass=QueuePool)

        @event.listens_for(engine, "connect")
        def _connect(dbapi_conn: Any, _: Any) -> None:
            dbapi_conn.isolation_level = None  # pysqlite's own BEGIN would defer the lock; we issue ours
            sqlite_driver.load_extensions(dbapi_conn)  # the search index's vector tables live in this database
            if not read_only:
                dbapi_conn.execute("PRAGMA journal_mode=WAL")
                dbapi_conn.execute("PRAGMA synchronous=NORMAL")
            dbapi_conn.execute("PRAGMA busy_timeout=30000")

        @event.listens_for(engine, "begin")
        def _begin(conn: Connection) -> None:
            conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

        return engine

    @staticmethod
    def check(conn: Connection) -> None:
        """Before migrating: a SQLite that has what the queue uses, and a file whose pages are sound."""
        check_sqlite_version()
        check_integrity(conn)

    @staticmethod
    def insert_new(table: Table, values: Mapping[str, Any]) -> Insert:
        return sqlite.insert(table).values(**values).prefix_with("OR IGNORE")

    @staticmethod
    def notify(conn: Connection) -> None:
        """Nothing to do: the only worker is woken by its own watcher, or finds the job at its next poll."""

    def listen(self, wake: Callable[[], None], stop: threading.Event) -> threading.Thread | None:
        return None

    @staticmethod
    def now(conn: Connection) -> float:
        """The time leases and backoffs are reckoned in: this machine's clock, the only one that uses the file."""
        return time.time()

    # -- migrations' bookkeeping ----------------------------------------------------------------------

    @staticmethod
    def schema_version(conn: Connection) -> int:
        return conn.exec_driver_sql("PRAGMA user_version").scalar_one()

    @staticmethod
    def set_schema_version(conn: Connection, version: int) -> None:
        conn.exec_driver_sql(f"PRAGMA user_version = {int(version)}")

    @staticmethod
    def lock_schema(conn: Connection) -> None:
        """Nothing to do: the migrating transaction began IMMEDIATE, which already excludes other writers."""

    @staticmethod
    def ddl(statement: str) -> str:
        return statement


class PostgreSQL:
    """A server that every machine's workers reach: the queue is shared."""

    name: ClassVar[str] = "postgresql"
    shared: ClassVar[bool] = True
    IDENTITY = "id INTEGER GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY"

    def __init__(self, url: str) -> None:
        parsed = make_url(url)
        if parsed.get_backend_name() != "postgresql":
            raise ValueError(f"queue url {parsed.render_as_string()!r}: only postgresql://… URLs are supported")
        self.url: URL = parsed.set(drivername="postgresql+psycopg")

    def engines(self, *, read_only: bool) -> tuple[Engine | None, Engine]:
        engine = create_engine(self.url, pool_size=2, max_overflow=4, pool_pre_ping=True,
                               connect_args={"connect_timeout": 10})
        patience = 0.0 if read_only else RECONNECT_SECONDS  # `status` answers at once; a worker waits it out

        @event.listens_for(engine, "do_connect")
        def _connect(dialect: Any, _record: Any, cargs: Any, cparams: Any) -> Any:
            return _connect_patiently(lambda: dialect.connect(*cargs, **cparams), patience)

        if read_only:
            return None, engine.execution_options(postgresql_readonly=True)
        return engine, engine

    @staticmethod
    def check(conn: Connection) -> None:
        """Nothing to check here: the server keeps its own files sound."""

    @staticmethod
    def insert_new(table: Table, values: Mapping[str, Any]) -> Insert:
        return postgresql.insert(table).values(**values).on_conflict_do_nothing()

    @staticmethod
    def notify(conn: Connection) -> None:
        """Wake idle workers everywhere; PostgreSQL delivers it when (and only if) the transaction commits."""
        conn.exec_driver_sql(f"NOTIFY {CHANNEL}")

    def listen(self, wake: Callable[[], None], stop: threading.Event) -> threading.Thread:
        """A thread that calls `wake` for every NOTIFY, and once after each (re)connection, since whatever
        was queued while it was not listening went unannounced. It reconnects after a server restart."""
        conninfo = self.url.set(drivername="postgresql").render_as_string(hide_password=False)
        thread = threading.Thread(target=_listen, args=(conninfo, wake, stop), name="queue-listen", daemon=True)
        thread.start()
        return thread

    @staticmethod
    def try_hold(conn: Connection, name: str) -> bool:
        """Take the session lock named `name` on `conn` if no other session holds it; it lasts as long as `conn`."""
        key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)
        held = bool(conn.exec_driver_sql("SELECT pg_try_advisory_lock(%s)", (key,)).scalar_one())
        conn.commit()  # a session lock outlives the transaction; the connection must not sit idle in one
        return held

    @staticmethod
    def let_go(conn: Connection) -> None:
        """Release `conn`'s session locks now: the server ends a closed connection's session a moment after the
        client has moved on, and a successor started at once would still find them held."""
        conn.exec_driver_sql("SELECT pg_advisory_unlock_all()")
        conn.commit()

    @staticmethod
    def now(conn: Connection) -> float:
        """The server's clock, one for every machine: a worker whose own clock is behind would otherwise write
        leases that others already find expired (and one ahead, leases that outlive its death)."""
        return conn.exec_driver_sql("SELECT extract(epoch FROM clock_timestamp())::float8").scalar_one()

    # -- migrations' bookkeeping ----------------------------------------------------------------------

    @staticmethod
    def schema_version(conn: Connection) -> int:
        if conn.exec_driver_sql("SELECT to_regclass('npumoed_schema')").scalar() is None:
            return 0
        return conn.exec_driver_sql("SELECT coalesce(max(version), 0) FROM npumoed_schema").scalar_one()

    @staticmethod
    def set_schema_version(conn: Connection, version: int) -> None:
        conn.exec_driver_sql("CREATE TABLE IF NOT EXISTS npumoed_schema (version INTEGER NOT NULL)")
        conn.exec_driver_sql("DELETE FROM npumoed_schema")
        conn.exec_driver_sql(f"INSERT INTO npumoed_schema (version) VALUES ({int(version)})")

    @staticmethod
    def lock_schema(conn: Connection) -> None:
        """Machines starting together take turns: the lock lasts until this transaction ends."""
        conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({SCHEMA_LOCK})")

    @classmethod
    def ddl(cls, statement: str) -> str:
        """The migrations are written for SQLite; an `INTEGER PRIMARY KEY` id is PostgreSQL's identity column."""
        return statement.replace("id INTEGER PRIMARY KEY", cls.IDENTITY)


Dialect = SQLite | PostgreSQL


def open_dialect(location: str | Path) -> Dialect:
    """`postgresql://…` is a shared queue; anything else is the path of a SQLite file."""
    return PostgreSQL(str(location)) if is_url(location) else SQLite(Path(location))


def dialect_of(conn: Connection) -> type[Dialect]:
    return PostgreSQL if conn.dialect.name == PostgreSQL.name else SQLite


def _connect_patiently(connect: Callable[[], Any], patience: float) -> Any:
    """Connect, retrying with backoff for up to `patience` seconds while the server is unreachable."""
    import psycopg

    deadline, delay = time.monotonic() + patience, 0.2
    while True:
        try:
            return connect()
        except psycopg.OperationalError as e:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("queue server unreachable (%s); retrying in %.1f s", str(e).strip(), delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def _listen(conninfo: str, wake: Callable[[], None], stop: threading.Event) -> None:
    import psycopg

    delay = 0.2
    while not stop.is_set():
        try:
            with psycopg.connect(conninfo, autocommit=True, connect_timeout=10) as conn:
                conn.execute(f"LISTEN {CHANNEL}")
                delay = 0.2
                wake()
                while not stop.is_set():
                    for _ in conn.notifies(timeout=1.0, stop_after=1):
                        wake()
        except psycopg.Error as e:
            log.info("queue wake-ups interrupted (%s); listening again in %.1f s", str(e).strip(), delay)
            stop.wait(delay)
            delay = min(delay * 2, 5.0)
