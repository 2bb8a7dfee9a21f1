"""Make packages fail to import in child processes, as on a machine where they are missing or broken.

Extraction runs in a child process that inherits this process's environment: a folder of stand-in packages
that raise ImportError, put first on PYTHONPATH, hides the installed ones from the child only.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def block_imports(folder: Path, monkeypatch: pytest.MonkeyPatch, *packages: str) -> None:
    """From now on (in child processes), importing any of `packages` raises ImportError naming it."""
    for package in packages:
        (folder / package).mkdir(parents=True)
        message = f"No module named {package!r} (blocked by the test)"
        (folder / package / "__init__.py").write_text(f"raise ImportError({message!r}, name={package!r})\n")
    inherited = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), *inherited]))
