"""The engine's commands, run with click's CliRunner: make-tiny, calibrate, plan show."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from npumoe.daemon.cli import engine as cli_engine
from npumoe.daemon.cli.engine import calibrate_command, model_group, plan_group, plan_show_command
from npumoe.engine.backends.registry import REGISTRY, backend_class
from npumoe.engine.calibration.planner import DEFAULT_GROUP_SIZE, DEFAULT_TIERS
from npumoe.engine.loading.load import load_model
from npumoe.engine.plan.cost import CostModel
from npumoe.engine.plan.cost_cache import CostCache
from npumoe.engine.plan.expert_plan import ExpertPlan
from npumoe.engine.plan.residency import MeasuredCosts, decide_residency
from npumoe.engine.synthetic.tiny import ARCHITECTURES

README = Path(__file__).parents[2] / "README.md"


pytestmark = pytest.mark.usefixtures("home")  # a private NPUMOED_HOME (tests/conftest.py)


def invoke(command, *args: str):
    return CliRunner().invoke(command, [str(a) for a in args], catch_exceptions=False)


def test_the_offline_demo_makes_a_model_calibrates_on_the_readme_and_shows_the_plan(tmp_path):
    model, plan = tmp_path / "tiny", tmp_path / "plan.json"
    made = invoke(model_group, "make-tiny", "qwen3_moe", model)
    assert made.exit_code == 0, made.output
    calibrated = invoke(calibrate_command, "--model", model, "--data", README, "--out", plan, "--threads", "1")
    assert calibrated.exit_code == 0, calibrated.output
    assert "loading the model in " in calibrated.output and "(weights auto -> " in calibrated.output
    shown = invoke(plan_group, "show", plan, "--json")
    assert shown.exit_code == 0, shown.output
    data = json.loads(shown.output)
    assert data == json.loads(plan.read_text())
    assert data["model_key"] == load_model(model).key
    assert "backend" not in data  # any backend runs it
    assert data["chunk_tokens"] == 512 and data["sources"] == ["README.md"]
    assert len(data["layers"]) == 3


def test_several_data_files_may_follow_one_data_option(tmp_path, tiny, harbour, orchard):
    paths = [tmp_path / "harbour.txt", tmp_path / "orchard.txt"]
    for path, text in zip(paths, (harbour, orchard), strict=True):
        path.write_text(text)
    plan = tmp_path / "plan.json"
    result = invoke(calibrate_command, "--model", tiny("olmoe"), "--data", *paths, "--chunk", "256", "--out", plan,
                    "--weights", "int8")
    assert result.exit_code == 0, result.output
    assert "loading the model in bfloat16 (weights int8)" in result.output  # int8's float part
    assert ExpertPlan.load(plan).sources == ("harbour.txt", "orchard.txt")


def test_the_commands_offer_what_the_engine_has_without_importing_it():
    """The CLI lists choices and defaults itself so that `npumoed --help` stays free of torch."""
    assert tuple(ARCHITECTURES) == cli_engine.ARCHITECTURES
    shown = next(p for p in plan_show_command.params if p.name == "backend")
    assert tuple(shown.type.choices) == tuple(REGISTRY) and all(backend_class(name) for name in REGISTRY)
    defaults = {p.name: p.default for p in calibrate_command.params}
    assert (defaults["n_tiers"], defaults["group_size"]) == (DEFAULT_TIERS, DEFAULT_GROUP_SIZE)


def test_plan_show_renders_tiers_and_layers_as_tables(tmp_path, tiny, harbour):
    text = tmp_path / "harbour.txt"
    text.write_text(harbour)
    plan = tmp_path / "plan.json"
    result = invoke(calibrate_command, "--model", tiny("mixtral"), "--data", text, "--chunk", "128", "--tiers", "2",
                    "--group-size", "2", "--out", plan)
    assert result.exit_code == 0, result.output
    loaded = ExpertPlan.load(plan)
    assert len(loaded.tiers) <= 2 and loaded.group_size == 2 and loaded.chunk_tokens == 128
    shown = invoke(plan_group, "show", plan)
    assert shown.exit_code == 0
    assert "Tiers" in shown.output and "Layers" in shown.output
    for capacity in loaded.tiers:
        assert str(capacity) in shown.output


def test_make_tiny_refuses_a_folder_that_is_not_empty(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    result = invoke(model_group, "make-tiny", "mixtral", tmp_path)
    assert result.exit_code == 1 and "exists and is not empty" in result.output


def test_calibrate_names_a_model_that_cannot_be_found(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello")
    result = invoke(calibrate_command, "--model", tmp_path / "missing", "--data", text, "--out", tmp_path / "p.json")
    assert result.exit_code == 1 and "missing" in result.output and "does not exist" in result.output


def test_plan_show_names_what_is_wrong_with_a_bad_plan(tmp_path):
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps({"format": "npumoe.expert-plan", "version": 7}))
    result = invoke(plan_group, "show", bad)
    assert result.exit_code == 1 and "plan version 7 is not supported" in result.output


def test_plan_show_with_a_backend_shows_where_groups_run_from_the_costs_measured_here(home, tmp_path, tiny, harbour):
    text = tmp_path / "harbour.txt"
    text.write_text(harbour)
    plan_path = tmp_path / "plan.json"
    assert invoke(calibrate_command, "--model", tiny("qwen3_moe"), "--data", text, "--chunk", "128",
                  "--out", plan_path).exit_code == 0
    plan = ExpertPlan.load(plan_path)
    unmeasured = invoke(plan_group, "show", plan_path, "--backend", "coreml")
    assert "costs not measured on this machine yet" in unmeasured.output
    assert "capacities aligned to multiples of 32" in unmeasured.output and "padding" in unmeasured.output
    cheap = CostModel(launch_s=1e-9, static_flops=1e15, cpu_call_s=1e-3, cpu_flops=1e9)
    CostCache(home / "costs").put("torch-static", plan, MeasuredCosts(cheap, 64, 32, "torch-static on the test"))
    measured = json.loads(invoke(plan_group, "show", plan_path, "--backend", "torch-static", "--json").output)
    residency = decide_residency(plan, backend_class("torch-static"), CostCache(home / "costs").get("torch-static",
                                                                                                     plan))
    assert measured["residency"]["measured_on"] == "torch-static on the test"
    assert sum(p["accelerator"] for layer in measured["residency"]["layers"] for p in layer) == \
        residency.accelerator_groups > 0
    shown = invoke(plan_group, "show", plan_path, "--backend", "torch-static").output
    assert f"{residency.accelerator_groups} groups on the accelerator" in shown and "torch-static on the test" in shown
