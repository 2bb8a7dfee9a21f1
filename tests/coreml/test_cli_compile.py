"""`npumoed compile`: a plan's loaded groups become a cached Core ML build in the home, once."""

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from npumoe.daemon.cli import main
from npumoe.engine.backends.coreml.cache import read_manifest


def npumoed(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def loaded_groups(plan) -> int:
    return sum(any(layer.load.mean[e] for e in g.experts) for layer in plan.layers for g in layer.groups)


@pytest.mark.slow  # converts every group of a real plan (make chaos); the sizing run converts a layer's by default
def test_compile_converts_every_group_calibration_saw_load_for_once(home: Path, tiny_model: Path,
                                                                    coreml_plan: Callable) -> None:
    plan_path, plan = coreml_plan()
    first = npumoed("compile", "--model", str(tiny_model), "--plan", str(plan_path), "--json")
    assert first.exit_code == 0, first.output
    summary = json.loads(first.stdout)
    # idle groups stay out; on a Mac residency picks among the rest from measured costs
    assert 0 < summary["functions"] == loaded_groups(plan) < sum(len(layer.groups) for layer in plan.layers)
    assert Path(summary["folder"]).is_relative_to(home / "compiled")
    assert not summary["reused"]
    assert summary["package_count"] == len(summary["packages"]) >= 1
    assert summary["bytes"] == sum(summary["packages"].values()) > 0
    for package in summary["packages"]:
        assert (Path(summary["folder"]) / package / "Manifest.json").is_file()
    manifest = read_manifest(Path(summary["folder"]))
    assert {g.capacity % 32 for g in manifest.groups} == {0}  # the Neural Engine's 64-byte rows of fp16

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


@pytest.mark.slow  # two real conversions racing (make chaos)
def test_two_processes_compiling_one_package_both_succeed_and_build_it_once(home: Path, tiny_model: Path,
                                                                            coreml_plan: Callable) -> None:
    plan_path, plan = coreml_plan()
    argv = [sys.executable, "-m", "npumoe.daemon", "compile", "--model", str(tiny_model), "--plan", str(plan_path),
            "--json"]
    runs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(run.wait(timeout=600), *run.communicate()) for run in runs]
    assert [code for code, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    summaries = [json.loads(out) for _, out, _ in results]
    assert sorted(s["reused"] for s in summaries) == [False, True]  # one built it, the other waited and took it
    assert summaries[0]["folder"] == summaries[1]["folder"]
    folder = Path(summaries[0]["folder"])
    assert len(read_manifest(folder).groups) == loaded_groups(plan)
    assert [p.name for p in folder.parent.iterdir() if ".partial-" in p.name] == []  # no half-built leftovers
