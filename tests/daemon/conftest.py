"""Fixtures the daemon's tests share: the test's home as the daemon sees it, its queue, and a `--once` worker on the
tiny model."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from npumoe.daemon.config import Config, CpuConfig, InboxConfig, ModelConfig, SchedulerConfig
from npumoe.daemon.energy.power import UnknownPowerSource
from npumoe.daemon.home import Home
from npumoe.daemon.model_choice import ModelSlot
from npumoe.daemon.scheduler import Scheduler
from npumoe.daemon.worker import Worker
from npumoe.jobs.queue.store import Queue


@pytest.fixture
def npumoed_home(home: Path) -> Home:
    """The test's NPUMOED_HOME (the `home` folder of tests/conftest.py), its folders made."""
    return Home(home).ensure()


@pytest.fixture
def queue(npumoed_home: Home) -> Queue:
    return Queue(npumoed_home.database)


@pytest.fixture
def make_worker(npumoed_home: Home, queue: Queue, tiny_model: Path) -> Callable[..., Worker]:
    """A `--once` worker on the tiny model; `loader` stands in for loading the engine, `clock` for the scheduler's."""

    def make(originals: str = "keep", loader: Callable[..., Any] | None = None,
             clock: Callable[[], datetime] | None = None) -> Worker:
        config = Config(
            inbox=InboxConfig(stable_seconds=0.1, originals=originals),
            model=ModelConfig(name=str(tiny_model), chunk_tokens=64, summary_tokens=8),
            scheduler=SchedulerConfig(poll_seconds=0.1),
            cpu=CpuConfig(threads=1, background_priority=False),  # never lower the test runner's own priority
        )
        scheduler = Scheduler(config.scheduler, queue, power=UnknownPowerSource(), foreground_load=lambda: 0.0,
                              clock=clock)
        model = ModelSlot(config, npumoed_home, loader=loader) if loader else None
        return Worker(config, npumoed_home, queue, once=True, scheduler=scheduler, model=model)

    return make
