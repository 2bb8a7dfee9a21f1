"""The command sets OpenMP's idle threads to sleep, not spin, before any area's module (which may load torch) is
imported; a setting the person made is kept."""

from __future__ import annotations

import importlib
import os

import pytest
from click.testing import CliRunner

from npumoe.daemon import cli


@pytest.fixture
def imported_with(monkeypatch: pytest.MonkeyPatch) -> dict[str, str | None]:
    """Each area module the command imports, with OMP_WAIT_POLICY as it stood at that moment."""
    seen: dict[str, str | None] = {}
    real = importlib.import_module

    def recording(name: str, *args, **kwargs):
        seen[name] = os.environ.get("OMP_WAIT_POLICY")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(cli.importlib, "import_module", recording)
    return seen


def test_openmp_waits_passively_from_before_an_area_module_loads(monkeypatch, imported_with):
    monkeypatch.setenv("OMP_WAIT_POLICY", "")  # recorded first, so that what the command sets is undone after
    monkeypatch.delenv("OMP_WAIT_POLICY")
    result = CliRunner().invoke(cli.main, ["doctor", "--help"])
    assert result.exit_code == 0, result.output
    assert imported_with == {"npumoe.daemon.cli.service": "PASSIVE"}


def test_the_person_s_own_wait_policy_is_kept(monkeypatch, imported_with):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert CliRunner().invoke(cli.main, ["doctor", "--help"]).exit_code == 0
    assert imported_with == {"npumoe.daemon.cli.service": "ACTIVE"}
