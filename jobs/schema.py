"""The queue's tables, and the forward migrations that bring any older database up to them.

The database records its schema version in `PRAGMA user_version`. Each migration moves it up by one
and only adds: an existing database is never dropped or rebuilt.
"""

from __future__ import annotations

from sqlalchemy import Column, Connection, Float, Integer, MetaData, String, Table, Text

from npumoe.jobs.errors import DatabaseUnusable

metadata = MetaData()

STATES = ("queued", "running", "done", "failed", "dead", "cancelled")

jobs = Table(
    "jobs",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("path", Text, nullable=False),
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
)

control = Table(  # v3: the person's switches (pause), kept apart from what the daemon writes
    "control",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", Text, nullable=False),
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
]

SCHEMA_VERSION = len(MIGRATIONS)


def check_integrity(conn: Connection) -> None:
    """SQLite's quick_check: the pages and indexes are sound (it skips the slower cross-checks of integrity_check)."""
    problems = [" ".join(row[0].split()) for row in conn.exec_driver_sql("PRAGMA quick_check").all()]
    if problems != ["ok"]:
        raise DatabaseUnusable(f"the database is damaged (quick_check: {'; '.join(problems[:3])})")


def schema_version(conn: Connection) -> int:
    return conn.exec_driver_sql("PRAGMA user_version").scalar_one()


def migrate(conn: Connection, target: int = SCHEMA_VERSION) -> int:
    """Apply the migrations past the database's version, up to `target`; returns the new version."""
    version = schema_version(conn)
    if version > SCHEMA_VERSION:
        raise DatabaseUnusable(f"database schema v{version} is newer than this npumoed (v{SCHEMA_VERSION}); "
                               "upgrade npumoed")
    for number in range(version + 1, target + 1):
        for statement in MIGRATIONS[number - 1]:
            conn.exec_driver_sql(statement)
        conn.exec_driver_sql(f"PRAGMA user_version = {number}")
    return max(version, target)
