"""Make packages fail to import in the extraction child, as on a machine where they are missing or broken.

The child starts isolated (`python -I`: no PYTHONPATH, no working directory on its path), so the stand-in
packages that raise ImportError reach it through its command: a folder of them put first on its sys.path.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from npumoe.jobs.extract import isolated


def block_imports(folder: Path, monkeypatch: pytest.MonkeyPatch, *packages: str) -> None:
    """From now on (in the extraction child), importing any of `packages` raises ImportError naming it."""
    for package in packages:
        (folder / package).mkdir(parents=True)
        message = f"No module named {package!r} (blocked by the test)"
        (folder / package / "__init__.py").write_text(f"raise ImportError({message!r}, name={package!r})\n")
    *python, _, module = isolated.CHILD_COMMAND  # [python, -I, -m, module]
    start = f"import runpy, sys; sys.path.insert(0, {str(folder)!r}); runpy.run_module({module!r}, run_name='__main__')"
    monkeypatch.setattr(isolated, "CHILD_COMMAND", [*python, "-c", start])
