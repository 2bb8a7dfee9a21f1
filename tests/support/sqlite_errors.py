"""Errors that a real SQLite (the bundled one the queue uses) raises, made on demand, raw or as SQLAlchemy
raises them: a database grown past its page limit is SQLITE_FULL, a write lock held past a busy timeout is
"database is locked", a file of garbage is not a database."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlean
from sqlalchemy.exc import DBAPIError


def disk_full(tmp_path: Path) -> sqlean.Error:
    conn = sqlean.connect(":memory:")
    conn.execute("PRAGMA max_page_count = 1")
    with pytest.raises(sqlean.Error) as full:
        conn.execute("CREATE TABLE one (x)")  # a table's page is more than the database may grow to
    return full.value


def locked(tmp_path: Path) -> sqlean.Error:
    holder = sqlean.connect(tmp_path / "locked.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    with pytest.raises(sqlean.Error) as busy:
        sqlean.connect(tmp_path / "locked.db", timeout=0).execute("CREATE TABLE t (x)")
    holder.execute("ROLLBACK")
    return busy.value


def not_a_database(tmp_path: Path) -> sqlean.Error:
    (tmp_path / "garbage.db").write_bytes(b"not a database, just bytes" * 200)
    with pytest.raises(sqlean.Error) as damaged:
        sqlean.connect(tmp_path / "garbage.db").execute("SELECT * FROM sqlite_master")
    return damaged.value


def as_sqlalchemy_raises_it(error: sqlean.Error) -> DBAPIError:
    return DBAPIError.instance("UPDATE jobs SET state = ?", ("done",), error, sqlean.Error)
