"""The daemon's one model: the engine's settings made from the config, and the model loaded once and let go."""

from __future__ import annotations

from pathlib import Path

import pytest

from npumoe.daemon.config import Config, ModelConfig
from npumoe.daemon.home import Home
from npumoe.daemon.model_choice import ModelNotFound, ModelSlot, engine_settings, output_settings, resolve_model


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class LoadedEngine:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_the_model_is_loaded_once_and_unloaded_after_the_idle_timeout(tmp_path: Path) -> None:
    loads: list[LoadedEngine] = []
    clock = FakeClock()
    config = Config(model=ModelConfig(name=str(tmp_path), idle_unload_seconds=300))
    slot = ModelSlot(config, Home(tmp_path), loader=lambda settings: loads.append(LoadedEngine()) or loads[-1],
                     clock=clock)
    first = slot.load()
    clock.now += 200
    assert slot.load() is first and len(loads) == 1
    clock.now += 299
    assert not slot.unload_if_idle() and slot.loaded
    clock.now += 2
    assert slot.unload_if_idle() and not slot.loaded and first.closed
    slot.load()
    assert len(loads) == 2


def test_a_model_that_does_not_exist_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="does not exist"):
        resolve_model(str(tmp_path / "missing"))
    assert resolve_model("Qwen/Qwen3-30B-A3B") == "Qwen/Qwen3-30B-A3B"  # for the engine's HF cache lookup


def test_the_coreml_backend_finds_the_graphs_npumoed_compile_built(tmp_path: Path) -> None:
    config = Config(model=ModelConfig(name=str(tmp_path), backend="coreml", coreml_compute_units="all"))
    settings = engine_settings(config, Home(tmp_path), threads=1)
    assert (settings.compiled_dir, settings.coreml_compute_units) == (Home(tmp_path).compiled, "all")


def test_the_section_and_chunk_lengths_reach_the_engine(tmp_path: Path) -> None:
    config = Config(model=ModelConfig(name=str(tmp_path), section_tokens=4096, chunk_tokens=256))
    settings = engine_settings(config, Home(tmp_path), threads=1)
    assert (settings.section_tokens, settings.chunk_tokens) == (4096, 256)


def test_every_output_setting_reaches_the_engine_as_configured(tmp_path: Path) -> None:
    config = Config(model=ModelConfig(name=str(tmp_path), backend="torch-static", overflow="prune", weights="int8",
                                      chunk_tokens=96, summary_tokens=40, section_tokens=2048, pooling="last"))
    settings = engine_settings(config, Home(tmp_path), threads=1)
    configured = output_settings(config)
    assert {name: getattr(settings, name) for name in configured} == {**configured, "plan": None}  # "": no plan
