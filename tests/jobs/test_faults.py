"""The one classifier of machine faults, on the errors a real SQLite raises (sqlite_errors.py), as they reach
the queue."""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlean
from support.sqlite_errors import as_sqlalchemy_raises_it, disk_full, locked, not_a_database

from npumoe.jobs.faults import machine_fault


@pytest.mark.parametrize(("make", "code", "words"), [
    (disk_full, errno.ENOSPC, "disk full"),
    (locked, errno.EBUSY, "the database is busy"),
])
@pytest.mark.parametrize("wrap", [as_sqlalchemy_raises_it, lambda e: e], ids=["sqlalchemy", "dbapi"])
def test_the_databases_own_faults_are_machine_faults_met_in_its_folder(
    tmp_path: Path, make: Callable[[Path], sqlean.Error], code: int, words: str,
    wrap: Callable[[sqlean.Error], BaseException],
) -> None:
    database = tmp_path / "home" / "npumoed.db"
    database.parent.mkdir()
    fault = machine_fault(wrap(make(tmp_path)), tmp_path / "outbox", database=database)
    assert fault is not None and fault.code == code and fault.folder == database.parent
    assert str(fault).startswith(words) and str(fault).endswith(f"in the queue database {database}")
    assert fault.cleared()  # the home's disk has room, and nothing holds the lock any more


def test_a_server_databases_fault_names_no_file_and_is_left_to_the_next_attempt(tmp_path: Path) -> None:
    fault = machine_fault(as_sqlalchemy_raises_it(disk_full(tmp_path)), tmp_path)
    assert fault is not None and fault.folder is None and str(fault) == "disk full in the queue database"
    assert fault.cleared()


def test_a_damaged_database_or_a_statements_own_error_is_no_machine_fault(tmp_path: Path) -> None:
    conn = sqlean.connect(":memory:")
    conn.execute("CREATE TABLE t (x UNIQUE)")
    conn.execute("INSERT INTO t VALUES (1)")
    with pytest.raises(sqlean.IntegrityError) as duplicate:
        conn.execute("INSERT INTO t VALUES (1)")
    for error in (not_a_database(tmp_path), duplicate.value):
        assert machine_fault(as_sqlalchemy_raises_it(error), tmp_path, database=tmp_path / "x.db") is None
