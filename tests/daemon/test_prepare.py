"""`npumoed prepare`: checkpoint to ready config in one command; a second run redoes nothing."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result

from npumoe.daemon.cli import main
from npumoe.daemon.model_choice import backend_description
from npumoe.engine.backends.coreml.env import coreml_availability
from npumoe.engine.calibration import planner
from npumoe.engine.plan.cost import CostModel
from npumoe.engine.plan.cost_cache import CostCache
from npumoe.engine.plan.expert_plan import ExpertPlan
from npumoe.jobs.summary_file import read_summary

CONFIG = """# my settings
[scheduler]
max_foreground_load = 100.0  # let the tests run beside other work

[model]
summary_tokens = 16
"""


def prepare(*args: str) -> Result:
    return CliRunner().invoke(main, ["prepare", *args], catch_exceptions=False)


@pytest.fixture
def calibrations(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Counts the calibrations prepare runs (the real ones)."""
    made: list[str] = []
    real = planner.plan_loaded

    def counted(loaded, texts, **options):
        made.append(loaded.key)
        return real(loaded, texts, **options)

    monkeypatch.setattr(planner, "plan_loaded", counted)
    return made


@pytest.fixture
def document(tmp_path: Path, harbour: str) -> Path:
    path = tmp_path / "harbour.txt"
    path.write_text(harbour[:4000])
    return path


def test_prepare_writes_plan_costs_and_config_then_reuses_every_stage(home: Path, tiny_model: Path, document: Path,
                                                                      calibrations: list[str]) -> None:
    home.mkdir(parents=True)
    (home / "config.toml").write_text(CONFIG)
    first = prepare("--model", str(tiny_model), "--data", str(document), "--backend", "torch-static", "--chunk", "128")
    assert first.exit_code == 0, first.output
    assert len(calibrations) == 1
    config = tomllib.loads((home / "config.toml").read_text())
    assert config["model"]["backend"] == "torch-static" and config["model"]["name"] == str(tiny_model)
    assert config["model"]["summary_tokens"] == 16 and config["scheduler"]["max_foreground_load"] == 100.0
    assert (home / "config.toml").read_text().startswith("# my settings")  # the rest of the file is kept
    assert (home / "config.toml.bak").read_text() == CONFIG
    plan = ExpertPlan.load(Path(config["model"]["plan"]))
    assert plan.chunk_tokens == 128 and plan.sources == ("harbour.txt",)
    assert CostCache(home / "costs").get("torch-static", plan) is not None

    again = prepare("--model", str(tiny_model), "--data", str(document), "--backend", "torch-static", "--chunk", "128")
    assert again.exit_code == 0, again.output
    assert len(calibrations) == 1  # nothing calibrated again
    outcomes = {cells[0]: cells[1] for line in again.output.splitlines() if line.count("│") > 2
                for cells in [[cell.strip() for cell in line.split("│")[1:3]]] if cells[0]}
    assert outcomes == {"plan": "reused", "costs": "reused", "config": "reused"}, again.output

    other = prepare("--model", str(tiny_model), "--data", str(document), "--backend", "torch-static", "--chunk", "64")
    assert other.exit_code == 0 and len(calibrations) == 2  # a changed input redoes the stages after it


def test_print_shows_the_model_section_and_leaves_the_file(home: Path, tiny_model: Path, document: Path) -> None:
    home.mkdir(parents=True)
    old_dtype = CONFIG + 'dtype = "bfloat16"\n'  # from before weights: kept as its format, the old key dropped
    (home / "config.toml").write_text(old_dtype)
    result = prepare("--model", str(tiny_model), "--data", str(document), "--backend", "cpu", "--chunk", "128",
                     "--print")
    assert result.exit_code == 0, result.output
    assert (home / "config.toml").read_text() == old_dtype
    printed = tomllib.loads(result.stdout)["model"]
    assert printed["backend"] == "cpu" and printed["summary_tokens"] == 16 and Path(printed["plan"]).is_file()
    assert printed["weights"] == "bf16" and "dtype" not in printed


def test_auto_takes_the_backend_the_measured_costs_expect_to_be_faster(home: Path, tiny_model: Path,
                                                                       document: Path) -> None:
    result = prepare("--model", str(tiny_model), "--data", str(document), "--chunk", "128")
    assert result.exit_code == 0, result.output
    chosen = tomllib.loads((home / "config.toml").read_text())["model"]["backend"]
    assert chosen in ("cpu", "torch-static")  # no Neural Engine here
    assert "expected MoE seconds per chunk" in result.output


@pytest.mark.slow
def test_prepare_for_coreml_off_macos_then_run_once_equals_torch_static(home: Path, tmp_path: Path,
                                                                        tiny_model: Path, document: Path,
                                                                        orchard: str, npumoed) -> None:
    """The Mac path on Linux: compiled packages and a coreml config; the document's outputs are torch-static's."""
    home.mkdir(parents=True)
    (home / "config.toml").write_text(CONFIG)
    result = prepare("--model", str(tiny_model), "--data", str(document), "--backend", "coreml", "--chunk", "128")
    assert result.exit_code == 0, result.output
    config = tomllib.loads((home / "config.toml").read_text())["model"]
    assert config["backend"] == "coreml"
    assert list((home / "compiled").rglob("manifest.json"))
    (home / "inbox" / "orchard.txt").write_text(orchard[:3000])
    coreml = npumoed("run", "--once", timeout=900)
    assert coreml.returncode == 0, coreml.stderr
    assert coreml.stderr.count("running its group graphs with torch-static instead") == 1  # one warning
    outputs = {"coreml": next((home / "outbox").iterdir())}
    # the same plan on torch-static, in a home of its own
    other = tmp_path / "torch-static-home"
    (other / "inbox").mkdir(parents=True)
    (other / "config.toml").write_text((home / "config.toml").read_text().replace('backend = "coreml"',
                                                                                   'backend = "torch-static"'))
    (other / "inbox" / "orchard.txt").write_text(orchard[:3000])
    static = subprocess.run([sys.executable, "-m", "npumoe.daemon", "run", "--once"], capture_output=True,
                            text=True, timeout=900, env={**os.environ, "NPUMOED_HOME": str(other)})
    assert static.returncode == 0, static.stderr
    outputs["torch-static"] = next((other / "outbox").iterdir())
    meta = {name: json.loads((out / "meta.json").read_text()) for name, out in outputs.items()}
    assert meta["coreml"]["residency"]["fallback"] and meta["torch-static"]["residency"]["fallback"] is None
    np.testing.assert_allclose(np.load(outputs["coreml"] / "embeddings.npy"),
                               np.load(outputs["torch-static"] / "embeddings.npy"), rtol=1e-4, atol=1e-5)
    summary = {name: read_summary(out).text for name, out in outputs.items()}
    assert summary["coreml"] == summary["torch-static"]


def test_run_once_with_forced_placement_runs_the_plan_in_graphs_with_the_cpu_paths_outputs(
        home: Path, tmp_path: Path, tiny_model: Path, document: Path, orchard: str) -> None:
    """Costs under which no graph pays here: measured residency runs every expert on the CPU, the accelerator policy
    runs the plan's groups as torch-static graphs, and under spill the document's outputs are the same."""
    home.mkdir(parents=True)
    (home / "config.toml").write_text(CONFIG)
    assert prepare("--model", str(tiny_model), "--data", str(document), "--backend", "torch-static",
                   "--chunk", "128").exit_code == 0
    plan = ExpertPlan.load(Path(tomllib.loads((home / "config.toml").read_text())["model"]["plan"]))
    cache = CostCache(home / "costs")
    no_graph_pays = CostModel(launch_s=10.0, static_flops=1.0, cpu_call_s=1e-12, cpu_flops=1e18)
    cache.put("torch-static", plan, dataclasses.replace(cache.get("torch-static", plan), cost=no_graph_pays))
    outputs = {}
    for policy in ("measured", "accelerator"):
        policy_home = tmp_path / policy
        shutil.copytree(home, policy_home)
        config = policy_home / "config.toml"
        config.write_text(config.read_text().replace("[model]\n", f'[model]\nresidency = "{policy}"\n'))
        (policy_home / "inbox").mkdir(exist_ok=True)
        (policy_home / "inbox" / "orchard.txt").write_text(orchard[:3000])
        ran = subprocess.run([sys.executable, "-m", "npumoe.daemon", "run", "--once"], capture_output=True, text=True,
                             timeout=900, env={**os.environ, "NPUMOED_HOME": str(policy_home)})
        assert ran.returncode == 0, ran.stderr
        outputs[policy] = next((policy_home / "outbox").iterdir())
    static = {policy: json.loads((out / "meta.json").read_text())["dispatch"]["static"]
              for policy, out in outputs.items()}
    assert static["measured"] == 0 and static["accelerator"] > 0
    np.testing.assert_allclose(np.load(outputs["accelerator"] / "embeddings.npy"),
                               np.load(outputs["measured"] / "embeddings.npy"), rtol=1e-4, atol=1e-5)
    assert read_summary(outputs["accelerator"]).text == read_summary(outputs["measured"]).text


def test_status_says_when_coreml_graphs_run_through_torch() -> None:
    available, reason = coreml_availability()
    described = backend_description("coreml")
    assert described == ("coreml" if available else f"coreml (graphs through torch: {reason})")
    assert backend_description("torch-static") == "torch-static"


def test_prepare_takes_a_gguf_file_and_reuses_its_stages(home: Path, tiny_gguf, document: Path,
                                                         calibrations: list[str]) -> None:
    from npumoe.engine.loading.resolve import model_key

    file = tiny_gguf("qwen3_moe", "Q4_0")
    args = ("--model", str(file), "--data", str(document), "--backend", "cpu", "--chunk", "128")
    first = prepare(*args)
    assert first.exit_code == 0, first.output
    assert calibrations == [model_key(file)]
    config = tomllib.loads((home / "config.toml").read_text())["model"]
    assert config["name"] == str(file) and config["backend"] == "cpu"
    assert ExpertPlan.load(Path(config["plan"])).model_key == model_key(file)
    again = prepare(*args)
    assert again.exit_code == 0 and calibrations == [model_key(file)]  # the file unchanged: nothing calibrated again


def test_prepare_reads_a_quantized_files_experts_straight_into_the_format_they_run_in(
        home: Path, tiny_gguf, document: Path, calibrations: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A quantized file is never held in float on the way to a plan: calibration and the costs run on the experts as
    the engine will hold them."""
    from npumoe.engine.loading import load as loading

    loads: list[tuple[bool, str | None]] = []
    real = loading.load_model

    def spied(*args, **kwargs):
        loads.append((kwargs.get("pack", False), kwargs.get("format")))
        return real(*args, **kwargs)

    monkeypatch.setattr(loading, "load_model", spied)
    file = tiny_gguf("qwen3_moe", "Q4_0")
    result = prepare("--model", str(file), "--data", str(document), "--backend", "torch-static", "--weights", "int4",
                     "--chunk", "128")
    assert result.exit_code == 0, result.output
    assert loads == [(True, "int4")] and len(calibrations) == 1
    assert "groups on the accelerator" in result.output
