"""`npumoed` on a machine with two faults: one file's reads fail with EIO once it is queued, and the queue's
database is found full while one document is being marked done.

    python faulty_npumoed.py UNREADABLE FILLS MARKERS npumoed-arguments…

UNREADABLE: the file name whose every open after the first (intake's, which queues it) fails with EIO, as a
sector that went bad would. FILLS: the file name whose job, the first time it is completed, meets a database
that cannot grow: a real SQLite connection to the queue's file, limited to the pages it has (`max_page_count`),
is asked to write, and its SQLITE_FULL is raised as SQLAlchemy raises the queue's errors. MARKERS: a folder
whose files remember, across the daemon's lives (it is killed and started again), what has happened already.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path
from typing import Any

import sqlean
from sqlalchemy.exc import DBAPIError

from npumoe.jobs import files
from npumoe.jobs.queue.store import Queue


class BadSector:
    """`os` as jobs/files.py sees it, except that `name` cannot be read once it has been opened once."""

    def __init__(self, name: str, armed: Path) -> None:
        self.name, self.armed = name, armed

    def __getattr__(self, attribute: str) -> object:
        return getattr(os, attribute)

    def open(self, path: Any, *args: Any, **kwargs: Any) -> int:
        if os.path.basename(os.fsdecode(path)) == self.name:
            if self.armed.exists():
                raise OSError(errno.EIO, os.strerror(errno.EIO), os.fsdecode(path))
            self.armed.touch()  # intake's read, which queues it: from now on the sector is bad
        return os.open(path, *args, **kwargs)


def database_full(database: Path) -> DBAPIError:
    """The error of a write to `database` that would need one page more than SQLite may give it."""
    conn = sqlean.connect(database, isolation_level=None, timeout=30)
    try:
        (pages,) = conn.execute("PRAGMA page_count").fetchone()
        conn.execute(f"PRAGMA max_page_count = {pages}")
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("CREATE TABLE chaos_filler (x)")
        conn.execute("INSERT INTO chaos_filler VALUES (zeroblob(1 << 20))")
    except sqlean.Error as e:
        return DBAPIError.instance("UPDATE jobs SET state = ?", ("done",), e, sqlean.Error)
    finally:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        conn.close()
    raise AssertionError("the database grew past max_page_count")


def fill_once(name: str, hit: Path) -> None:
    real_complete = Queue.complete

    def complete(queue: Queue, job_id: int, *args: Any, **kwargs: Any) -> bool:
        job = queue.get(job_id)
        if job is not None and Path(job.path).name == name and not hit.exists():
            hit.touch()
            raise database_full(queue.path)
        return real_complete(queue, job_id, *args, **kwargs)

    Queue.complete = complete  # type: ignore[method-assign]


if __name__ == "__main__":
    unreadable, fills, markers = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    files.os = BadSector(unreadable, markers / "sector-bad")  # type: ignore[assignment]
    fill_once(fills, markers / "database-filled")
    sys.argv = ["npumoed", *sys.argv[4:]]
    from npumoe.daemon.cli import main

    main()
