"""The watcher's memory of the inbox files already handed on, so that a restart does not hash them again."""

from __future__ import annotations

from collections.abc import Collection

from sqlalchemy import delete, insert, select, update

from ..files import Identity
from .database import Database
from .schema import inbox_files


class HandedFiles:
    def __init__(self, db: Database) -> None:
        self.db = db

    def all(self) -> dict[str, Identity]:
        with self.db.read() as conn:
            rows = conn.execute(select(inbox_files)).all()
        return {r.path: Identity(r.device, r.inode, r.size, r.mtime_ns) for r in rows}

    def remember(self, path: str, identity: Identity) -> None:
        values = {"device": identity.device, "inode": identity.inode, "size": identity.size,
                  "mtime_ns": identity.mtime_ns}
        with self.db.tx() as conn:
            if conn.execute(update(inbox_files).where(inbox_files.c.path == path).values(**values)).rowcount == 0:
                conn.execute(insert(inbox_files).values(path=path, **values))

    def forget(self, paths: Collection[str]) -> None:
        if not paths:
            return
        with self.db.tx() as conn:
            conn.execute(delete(inbox_files).where(inbox_files.c.path.in_(list(paths))))
