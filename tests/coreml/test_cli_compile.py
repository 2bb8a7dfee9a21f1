"""`npumoed compile`: a plan's accelerator groups become a cached Core ML build in the home."""

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from npumoe.daemon.cli import main


def npumoed(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_compile_converts_the_plans_accelerator_groups_once(home: Path, tiny_model: Path,
                                                            coreml_plan: Callable) -> None:
    plan_path, plan = coreml_plan()
    first = npumoed("compile", "--model", str(tiny_model), "--plan", str(plan_path), "--json")
    assert first.exit_code == 0, first.output
    summary = json.loads(first.stdout)
    assert summary["functions"] == 2 * len(plan.layers)  # two accelerator groups per layer; CPU groups stay out
    assert Path(summary["folder"]).is_relative_to(home / "compiled")
    assert not summary["reused"]
    for package in summary["packages"]:
        assert (Path(summary["folder"]) / package / "Manifest.json").is_file()

    again = json.loads(npumoed("compile", "--model", str(tiny_model), "--plan", str(plan_path), "--json").stdout)
    assert again["reused"] and again["folder"] == summary["folder"]


def test_compile_refuses_a_plan_made_for_another_model(home: Path, tiny_model: Path, coreml_plan: Callable) -> None:
    plan_path, _ = coreml_plan(model_key="other-model@0123456789abcdef")
    result = CliRunner().invoke(main, ["compile", "--model", str(tiny_model), "--plan", str(plan_path)])
    assert result.exit_code != 0
    assert "calibrated for other-model@0123456789abcdef" in result.output


def test_a_sizing_run_converts_every_group_of_a_random_layer(home: Path) -> None:
    result = npumoed("compile", "--geometry", "64x16x2x32", "--group-size", "8", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    manifest = json.loads((Path(summary["folder"]) / "manifest.json").read_text())
    assert sorted(e for g in manifest["groups"] for e in g["experts"]) == list(range(16))
    assert all(len(g["experts"]) <= 8 for g in manifest["groups"])


@pytest.mark.parametrize("args", [(), ("--geometry", "qwen3-30b-a3b", "--model", "demo"), ("--model", "demo")])
def test_compile_needs_a_model_and_plan_or_a_geometry(home: Path, args: tuple[str, ...]) -> None:
    result = CliRunner().invoke(main, ["compile", *args])
    assert result.exit_code == 2
    assert "give either --model and --plan, or --geometry" in result.output
