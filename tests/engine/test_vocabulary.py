"""The engine's vocabulary: one spelling of each choice, importable without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest


def imported_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running `code`."""
    done = subprocess.run([sys.executable, "-c", f"{code}\nimport sys; print(' '.join(sys.modules))"],
                          capture_output=True, text=True, check=True)
    return set(done.stdout.split())


def test_the_vocabulary_config_and_the_commands_load_without_torch():
    modules = imported_after("import npumoe.engine.vocabulary, npumoe.daemon.config, npumoe.daemon.cli.status_view, "
                             "npumoe.daemon.cli")
    assert "torch" not in modules
    assert "npumoe.engine.engine" not in modules  # the package's own names load only when asked for


def test_the_packages_names_still_load_on_first_use():
    import npumoe.engine as package
    from npumoe.engine import Engine, EngineSettings
    from npumoe.engine.engine import Engine as defined

    assert Engine is defined and EngineSettings.__module__ == "npumoe.engine.engine"
    with pytest.raises(AttributeError, match="has no attribute 'Engin'"):
        getattr(package, "Engin")  # noqa: B009 (the name is wrong on purpose)
