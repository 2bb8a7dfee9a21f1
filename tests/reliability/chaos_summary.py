"""The one line `make chaos` ends with: kills survived, documents processed, duplicates, losses.

The crash and load tests add their figures as they finish (before asserting on them, so a failing run
still reports what it saw); the reliability conftest prints the line once the session is over.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class Figures:
    kills: int = 0  # SIGKILLs delivered to a live daemon that a restart then recovered from
    processed: int = 0  # documents with exactly one done job and one complete output set
    duplicates: int = 0
    losses: int = 0
    status_seconds: list[float] = field(default_factory=list)  # each `npumoed status --json` while under load
    tests: list[str] = field(default_factory=list)

    def add(self, test: str, *, processed: int, duplicates: int, losses: int, kills: int = 0,
            status_seconds: list[float] | None = None) -> None:
        self.tests.append(test)
        self.kills += kills
        self.processed += processed
        self.duplicates += duplicates
        self.losses += losses
        self.status_seconds += status_seconds or []

    def line(self) -> str:
        seconds = self.status_seconds
        status = (
            f", npumoed status max {max(seconds):.2f} s (median {statistics.median(seconds):.2f} s, "
            f"{sum(s >= 1.0 for s in seconds)} of {len(seconds)} samples at 1 s or more)"
            if seconds else ""
        )
        return (f"chaos: {self.kills} kills survived, {self.processed} documents processed, "
                f"{self.duplicates} duplicates, {self.losses} losses{status} ({', '.join(self.tests)})")


FIGURES = Figures()
