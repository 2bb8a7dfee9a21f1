"""`npumoed compile` from a GGUF file: its packages are compressed as from the checkpoint it was written from.
Conversion runs on Linux; prediction is macOS-only (test_coreml_macos.py)."""

import json
from pathlib import Path

from click.testing import CliRunner

from npumoe.daemon.cli import main
from npumoe.engine.backends.coreml.cache import read_manifest
from npumoe.engine.calibration.calibrate import Calibration
from npumoe.engine.calibration.planner import make_plan
from npumoe.engine.loading.load import load_model
from npumoe.engine.moe.model_experts import moe_experts
from npumoe.engine.plan.expert_plan import ExpertLoad


def one_group_plan(model: Path, out: Path) -> Path:
    """A plan for `model` whose calibration saw load on the first four experts of its first layer only: one group
    to convert."""
    loaded = load_model(model)
    experts = loaded.model.config.num_experts
    busy = ExpertLoad(*([tuple(8.0 if e < 4 else 0.0 for e in range(experts))] * 4))
    idle = ExpertLoad(*([(0.0,) * experts] * 4))
    layers = tuple((name, busy if i == 0 else idle) for i, (name, _) in enumerate(moe_experts(loaded.model)))
    calibration = Calibration(chunk_tokens=64, tokens=640, chunks=10, sources=("test",), layers=layers)
    make_plan(calibration, model=model.name, model_key=loaded.key).save(out)
    return out


def compiled(model: Path, plan: Path, weights: str) -> dict:
    result = CliRunner().invoke(main, ["compile", "--model", str(model), "--plan", str(plan), "--weights", weights,
                                       "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_a_gguf_models_packages_are_compressed_as_its_checkpoints_are(home: Path, tiny_model: Path, tiny_gguf,
                                                                       tmp_path: Path) -> None:
    file = tiny_gguf("qwen3_moe", "F16")  # written from tiny_model
    for weights in ("int8", "int4"):
        from_file = compiled(file, one_group_plan(file, tmp_path / f"gguf-{weights}.json"), weights)
        from_folder = compiled(tiny_model, one_group_plan(tiny_model, tmp_path / f"folder-{weights}.json"), weights)
        assert from_file["functions"] == from_folder["functions"] == 1
        assert Path(from_file["folder"]).name.endswith(f"-{weights}") and from_file["weights"] == weights
        assert read_manifest(Path(from_file["folder"])).weights == weights
        assert from_file["bytes"] == from_folder["bytes"]  # the same compressed weights' layout, byte for byte


def test_with_weights_auto_a_quantized_gguf_is_compiled_in_the_format_the_engine_will_run(home: Path, tiny_gguf,
                                                                                         tmp_path: Path) -> None:
    file = tiny_gguf("qwen3_moe", "Q4_0")  # auto: int4, so the backend will look for int4 packages
    result = CliRunner().invoke(main, ["compile", "--model", str(file), "--plan",
                                       str(one_group_plan(file, tmp_path / "plan.json")), "--json"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["weights"] == "int4"
