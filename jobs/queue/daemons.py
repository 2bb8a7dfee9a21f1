"""The daemons' status rows: what each daemon is doing, written by it and read by `npumoed status`."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import insert, select, update

from .database import Database, reconnecting
from .schema import daemon

JSON_COLUMNS = ("power", "counters")


class DaemonRows:
    def __init__(self, db: Database) -> None:
        self.db = db

    @reconnecting
    def write(self, **values: Any) -> None:
        """Write this daemon's row (this home's; on a shared queue, this home on this host's); IdentityInUse
        while another live daemon has this one's identity, whose row it is."""
        self.db.hold_identity()
        for key in JSON_COLUMNS:
            if key in values and not isinstance(values[key], str | None):
                values[key] = json.dumps(values[key])
        values.update(host=self.db.host, home=self.db.home)
        with self.db.tx() as conn:
            if conn.execute(update(daemon).where(*self._own()).values(**values)).rowcount == 0:
                conn.execute(insert(daemon).values(**({} if self.db.shared else {"id": 1}), **values))

    @reconnecting
    def read(self) -> dict[str, Any] | None:
        """This daemon's row; None before it first wrote one."""
        with self.db.read() as conn:
            row = conn.execute(select(daemon).where(*self._own())).first()
        return _as_dict(row) if row is not None else None

    @reconnecting
    def all(self) -> list[dict[str, Any]]:
        """Every daemon's row: on a shared queue, one per home on every machine."""
        with self.db.read() as conn:
            rows = conn.execute(select(daemon).order_by(daemon.c.host, daemon.c.home)).all()
        return [_as_dict(row) for row in rows]

    def _own(self) -> tuple[Any, ...]:
        # A home's own SQLite file has one daemon row; a shared queue has one per home on each host.
        return (daemon.c.host == self.db.host, daemon.c.home == self.db.home) if self.db.shared else (daemon.c.id == 1,)


def _as_dict(row: Any) -> dict[str, Any]:
    d = dict(row._mapping)
    for key in JSON_COLUMNS:
        d[key] = json.loads(d[key]) if d[key] else None
    return d
