"""The person's switches (pause, …): small JSON values by key, set by the CLI and read by the daemon."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import insert, select, update

from .database import Database, reconnecting
from .schema import control


class Controls:
    def __init__(self, db: Database) -> None:
        self.db = db

    @reconnecting
    def set(self, key: str, value: Any) -> None:
        with self.db.tx() as conn:
            encoded = json.dumps(value)
            if conn.execute(update(control).where(control.c.key == key).values(value=encoded)).rowcount == 0:
                conn.execute(insert(control).values(key=key, value=encoded))

    @reconnecting
    def get(self, key: str, default: Any = None) -> Any:
        with self.db.read() as conn:
            value = conn.execute(select(control.c.value).where(control.c.key == key)).scalar()
        return json.loads(value) if value is not None else default
