"""The queue's tables, and the forward migrations that bring any older database up to them.

One schema for SQLite and PostgreSQL. The database records its schema version (SQLite in `PRAGMA
user_version`, PostgreSQL in a one-row table; see dialects.py). Each migration moves it up by one and
only adds: an existing database is never dropped or rebuilt. The migrations are SQL both dialects accept,
save for the spelling of an auto-numbered id, which the dialect adapts.
"""

from __future__ import annotations

import base64
import os
from typing import Any

from sqlalchemy import Column, Connection, Dialect, Float, Integer, MetaData, String, Table, Text
from sqlalchemy.types import TypeDecorator

from ..errors import DatabaseUnusable
from .dialects import dialect_of

metadata = MetaData()


class FsPath(TypeDecorator[str]):
    """An absolute file path, stored losslessly: as text when it is valid UTF-8, else as its raw bytes (a name
    that is not UTF-8 on Linux, which Python holds with surrogate escapes and neither database takes as text):
    SQLite keeps them as a BLOB, PostgreSQL's text column as `BYTES_PREFIX` + base64 (no absolute path starts
    so). Read back, it is the same `str` Python gave (os.fsdecode), so opening it finds the same file."""

    impl = Text
    cache_ok = True
    BYTES_PREFIX = "base64:"

    def process_bind_param(self, value: Any, dialect: Dialect) -> Any:
        if value is None:
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raw = os.fsencode(value)
            return raw if dialect.name == "sqlite" else self.BYTES_PREFIX + base64.b64encode(raw).decode()
        return value

    def process_result_value(self, value: Any, dialect: Dialect) -> str | None:
        if isinstance(value, str) and value.startswith(self.BYTES_PREFIX):
            return os.fsdecode(base64.b64decode(value.removeprefix(self.BYTES_PREFIX)))
        return os.fsdecode(value) if isinstance(value, bytes) else value


# A job's states: waiting, leased to a worker, finished, waiting to be retried, out of attempts, cancelled by hand.
QUEUED, RUNNING, DONE, FAILED, DEAD, CANCELLED = "queued", "running", "done", "failed", "dead", "cancelled"
STATES = (QUEUED, RUNNING, DONE, FAILED, DEAD, CANCELLED)

jobs = Table(
    "jobs",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("path", FsPath, nullable=False),
    Column("sha256", String(64), nullable=False),
    Column("model_key", Text, nullable=False),
    Column("settings_key", Text, nullable=False),
    Column("state", String(16), nullable=False),
    Column("priority", Integer, nullable=False),
    Column("attempts", Integer, nullable=False),
    Column("max_attempts", Integer, nullable=False),
    Column("run_after", Float, nullable=False),
    Column("lease_until", Float),
    Column("heartbeat_at", Float),
    Column("worker_pid", Integer),
    Column("progress", Float, nullable=False),
    Column("last_error", Text),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("finished_at", Float),
    Column("output_dir", Text),
    # v2
    Column("error_kind", String(32)),
    Column("detail", Text),  # JSON: chunks, tokens, rate, phase of the running job
    Column("batch_window", String(16)),  # "HH:MM-HH:MM": runs only inside it
    # v4: which worker runs (or ran) it, and the machine it must run on when its file is local to one
    Column("worker_host", String(255)),
    Column("worker_started", Float),  # the worker process's start time: with host and pid, its identity
    Column("pinned_host", String(255)),
    # v6: the claim that took it, so a claim run again after its answer was lost finds the job it took
    Column("claim_token", String(32)),
    # v7: hand-backs for a machine fault since the last attempt was spent (see Queue.hand_back)
    Column("handbacks", Integer, nullable=False, default=0),
)

daemon = Table(  # v3: one row, written by the running daemon, read by `npumoed status`
    "daemon",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("pid", Integer),
    Column("started_at", Float),
    Column("heartbeat_at", Float),
    Column("stopped_at", Float),
    Column("activity", Text),  # "working", "waiting", "idle"
    Column("reason", Text),  # why it waits, in words
    Column("current_job", Integer),
    Column("model", Text),
    Column("backend", Text),
    Column("power", Text),  # JSON
    Column("counters", Text),  # JSON
    # v4: one row per daemon (a home on a host) when several share a queue
    Column("host", String(255)),
    Column("home", Text),
)

control = Table(  # v3: the person's switches (pause), kept apart from what the daemon writes
    "control",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)

inbox_files = Table(  # v4: inbox files already handed on, so a restart does not hash them all again
    "inbox_files",
    metadata,
    Column("path", FsPath, primary_key=True),
    Column("device", Integer, nullable=False),
    Column("inode", Integer, nullable=False),
    Column("size", Integer, nullable=False),
    Column("mtime_ns", Integer, nullable=False),
)

MIGRATIONS: list[list[str]] = [
    [  # 1: the first queue
        """CREATE TABLE jobs (
            id INTEGER PRIMARY KEY,
            path TEXT NOT NULL,
            sha256 VARCHAR(64) NOT NULL,
            model_key TEXT NOT NULL,
            settings_key TEXT NOT NULL,
            state VARCHAR(16) NOT NULL CHECK (state IN
                ('queued', 'running', 'done', 'failed', 'dead', 'cancelled')),
            priority INTEGER NOT NULL DEFAULT 0,
            attempts INTEGER NOT NULL DEFAULT 0,
            max_attempts INTEGER NOT NULL DEFAULT 3,
            run_after FLOAT NOT NULL,
            lease_until FLOAT,
            heartbeat_at FLOAT,
            worker_pid INTEGER,
            progress FLOAT NOT NULL DEFAULT 0,
            last_error TEXT,
            created_at FLOAT NOT NULL,
            updated_at FLOAT NOT NULL,
            finished_at FLOAT,
            output_dir TEXT,
            UNIQUE (sha256, model_key, settings_key)
        )""",
        "CREATE INDEX jobs_claimable ON jobs (state, priority, run_after)",
    ],
    [  # 2: failure kinds, live progress detail, overnight batch windows
        "ALTER TABLE jobs ADD COLUMN error_kind VARCHAR(32)",
        "ALTER TABLE jobs ADD COLUMN detail TEXT",
        "ALTER TABLE jobs ADD COLUMN batch_window VARCHAR(16)",
    ],
    [  # 3: the daemon's heartbeat row and the person's switches
        """CREATE TABLE daemon (
            id INTEGER PRIMARY KEY, pid INTEGER, started_at FLOAT, heartbeat_at FLOAT, stopped_at FLOAT,
            activity TEXT, reason TEXT, current_job INTEGER, model TEXT, backend TEXT,
            power TEXT, counters TEXT
        )""",
        "CREATE TABLE control (key VARCHAR(64) PRIMARY KEY, value TEXT NOT NULL)",
    ],
    [  # 4: the inbox files handed on, by identity (device, inode, size, mtime)
        """CREATE TABLE inbox_files (
            path TEXT PRIMARY KEY, device INTEGER NOT NULL, inode INTEGER NOT NULL, size INTEGER NOT NULL,
            mtime_ns INTEGER NOT NULL
        )""",
    ],
    [  # 5: several machines on one queue: who runs a job, jobs pinned to a machine, one row per daemon
        "ALTER TABLE jobs ADD COLUMN worker_host VARCHAR(255)",
        "ALTER TABLE jobs ADD COLUMN worker_started FLOAT",
        "ALTER TABLE jobs ADD COLUMN pinned_host VARCHAR(255)",
        "ALTER TABLE daemon ADD COLUMN host VARCHAR(255)",
        "ALTER TABLE daemon ADD COLUMN home TEXT",
        "CREATE UNIQUE INDEX daemon_worker ON daemon (host, home)",
    ],
    [  # 6: the token of the claim that took a job (a claim replayed after a lost answer finds it)
        "ALTER TABLE jobs ADD COLUMN claim_token VARCHAR(32)",
        "CREATE INDEX jobs_claim_token ON jobs (claim_token)",  # looked up by every claim
    ],
    [  # 7: a job handed back for a machine fault counts how often, so one file cannot hold the queue for ever
        "ALTER TABLE jobs ADD COLUMN handbacks INTEGER NOT NULL DEFAULT 0",
    ],
]

SCHEMA_VERSION = len(MIGRATIONS)


def schema_version(conn: Connection) -> int:
    return dialect_of(conn).schema_version(conn)


def migrate(conn: Connection, target: int = SCHEMA_VERSION) -> int:
    """Apply the migrations past the database's version, up to `target`; returns the new version."""
    dialect = dialect_of(conn)
    dialect.lock_schema(conn)
    version = dialect.schema_version(conn)
    if version > SCHEMA_VERSION:
        raise DatabaseUnusable(f"database schema v{version} is newer than this npumoed (v{SCHEMA_VERSION}); "
                               "upgrade npumoed")
    for number in range(version + 1, target + 1):
        for statement in MIGRATIONS[number - 1]:
            conn.exec_driver_sql(dialect.ddl(statement))
        dialect.set_schema_version(conn, number)
    return max(version, target)
