"""Reliability tests: the summary line `make chaos` ends with, and a home configured for a real daemon."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from chaos_summary import FIGURES, Figures
from hostile_run import HostileRun, hostile_run


@pytest.fixture
def chaos_figures() -> Figures:
    return FIGURES


def pytest_unconfigure(config: pytest.Config) -> None:
    """After pytest's own last line, so that the summary is the line the run ends with."""
    if FIGURES.tests:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(FIGURES.line())
        else:
            print(FIGURES.line())


@pytest.fixture
def daemon_config(configure: Callable[[str], Path], tiny_model: Path) -> Callable[..., Path]:
    """Write a config for a real daemon on the tiny model that notices files quickly:
    `daemon_config(originals="move", max_attempts=30, summary_tokens=2)`."""

    def write(*, originals: str = "keep", max_attempts: int = 3, summary_tokens: int = 4) -> Path:
        return configure(f"""
[inbox]
stable_seconds = 0.3
rescan_seconds = 5
originals = "{originals}"

[model]
name = "{tiny_model}"
chunk_tokens = 64
summary_tokens = {summary_tokens}

[queue]
max_attempts = {max_attempts}
retry_base_seconds = 1

[scheduler]
max_foreground_load = 1.0  # other test runs share these cores; their load is not what these tests are about
poll_seconds = 0.3

[cpu]
threads = 1
background_priority = false  # at SCHED_IDLE on a busy shared machine the daemon could starve
""")

    return write


@pytest.fixture(scope="session")
def hostile(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> HostileRun:
    """One real `npumoed run --once` over every hostile input (see hostile_run.py), shared by the tests."""
    return hostile_run(tmp_path_factory.mktemp("hostile-daemon"), tiny_model)
