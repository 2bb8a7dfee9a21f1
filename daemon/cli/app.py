"""What every command shares: the config, the home and the queue, opened on first use."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import click
from filelock import FileLock, Timeout
from sqlalchemy.exc import OperationalError

from npumoe.jobs.errors import DatabaseUnusable
from npumoe.jobs.queue.store import Backoff, Queue

from ..config import Config, ConfigError, load_config, redacted_url
from ..home import Home
from ..service import EXIT_DO_NOT_RESTART


class BadConfig(click.ClickException):
    exit_code = 2

    def show(self, file: Any = None) -> None:
        click.echo(f"npumoed: bad config: {self.message}", err=True)


class UnusableDatabase(click.ClickException):
    """The queue database cannot be used: one line, and the status the service does not restart on."""

    exit_code = EXIT_DO_NOT_RESTART

    def __init__(self, path: Path, problem: DatabaseUnusable) -> None:
        super().__init__(f"cannot use the queue database {path}: {problem}; `npumoed doctor` says how to recover")

    def show(self, file: Any = None) -> None:
        click.echo(f"npumoed: {self.message}", err=True)


@dataclass
class App:
    config_path: Path | None = None
    _opened: list[Queue] = field(default_factory=list)

    @cached_property
    def config(self) -> Config:
        try:
            return load_config(self.config_path)
        except ConfigError as e:
            raise BadConfig(str(e)) from e

    @cached_property
    def home(self) -> Home:
        return Home.current().ensure()

    @cached_property
    def queue(self) -> Queue:
        q = self.config.queue
        try:
            queue = Queue(q.url or self.home.database, backoff=Backoff(q.retry_base_seconds, q.retry_max_seconds),
                          home=self.home.root)
        except DatabaseUnusable as e:
            raise UnusableDatabase(self.home.database, e) from e
        except OperationalError as e:
            where = redacted_url(q.url) if q.url else self.home.database
            raise click.ClickException(f"cannot open the queue at {where}: {str(e.orig).strip()}") from e
        self._opened.append(queue)
        return queue

    def close(self) -> None:
        for queue in self._opened:
            queue.close()


pass_app = click.make_pass_decorator(App)


@contextmanager
def holding_home(home: Home) -> Iterator[None]:
    """The home's lock, which a running daemon holds: for the commands that rewrite what the daemon writes."""
    lock = FileLock(home.lock, mode=0o600)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise click.ClickException(f"npumoed is running for {home.root}; stop it first "
                                   "(`npumoed uninstall`, or Ctrl-C where it runs)") from None
    try:
        yield
    finally:
        lock.release()


def emit_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
