"""Reliability tests: the summary line `make chaos` ends with, and a home configured for a real daemon."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from chaos_summary import FIGURES, Figures
from daemon_toml import daemon_toml
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
    """Write the home's config for a real daemon on the tiny model, in 64-token chunks:
    `daemon_config(originals="move", max_attempts=30, summary_tokens=2, background=True)`."""

    def write(*, summary_tokens: int = 4, **options: Any) -> Path:
        model = f'name = "{tiny_model}"\nchunk_tokens = 64\nsummary_tokens = {summary_tokens}'
        return configure(daemon_toml(model, **options))

    return write


@pytest.fixture(scope="session")
def hostile(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> HostileRun:
    """One real `npumoed run --once` over every hostile input (see hostile_run.py), shared by the tests."""
    return hostile_run(tmp_path_factory.mktemp("hostile-daemon"), tiny_model)
