"""SQLite with the sqlite-vec extension, one build on every machine.

The queue and the search index share the home's database, and the index's vector tables need the
sqlite-vec extension loaded on every connection that touches them. Python's own `sqlite3` cannot
always load extensions (many macOS builds, and some Linux ones, are compiled without it) and carries
whatever SQLite the platform has. `sqlean.py` is a drop-in DB-API module that bundles a recent SQLite
(3.50) with extension loading on: with it the queue and the index see the same SQLite everywhere,
including the FTS5 features (`contentless_delete`) the index relies on, which older SQLite lacks.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from urllib.parse import quote

import sqlean
import sqlite_vec

driver: ModuleType = sqlean  # the DB-API module: SQLAlchemy's pysqlite dialect takes it as `module=`
Connection = sqlean.Connection
BUSY_TIMEOUT_MS = 30_000


def load_extensions(conn: Connection) -> None:
    """Load sqlite-vec into `conn`; extension loading is switched off again straight after."""
    conn.enable_load_extension(True)
    try:
        sqlite_vec.load(conn)
    finally:
        conn.enable_load_extension(False)


def uri(path: Path, *, read_only: bool = False) -> str:
    """The `file:` URI that opens the database at `path`, the path quoted: a home may contain `#`, `?` or `%`,
    which a URI would read as its own syntax and open (and create) another file."""
    return f"file:{quote(str(Path(path).absolute()))}" + ("?mode=ro" if read_only else "")


def connect(path: Path, *, read_only: bool = False) -> Connection:
    """A connection with sqlite-vec loaded, in autocommit mode (callers open their own transactions)."""
    if read_only:
        if not Path(path).exists():
            raise FileNotFoundError(f"no database at {path}")
        conn = driver.connect(uri(path, read_only=True), uri=True, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000)
    else:
        conn = driver.connect(str(path), isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000)
        conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    load_extensions(conn)
    return conn
