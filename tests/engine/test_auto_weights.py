"""`weights = "auto"`: the fastest float dtype measured here, or the first smaller format that fits memory."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from npumoe.engine import Engine, EngineSettings, load_model
from npumoe.engine.kernels import choice as mechanism
from npumoe.engine.loading import auto_weights
from npumoe.engine.loading.auto_weights import choose_weights
from npumoe.engine.loading.model_size import MIN_RESERVE_BYTES, checkpoint_tensors, model_size, needed_bytes

PLENTY = 2**40


@pytest.fixture(scope="module")
def folder(tiny) -> Path:
    return tiny("qwen3_moe")


@pytest.fixture
def own_cache(tmp_path, monkeypatch) -> Path:
    """A user cache of the test's own and a fresh process: the float timings auto caches start out unmeasured."""
    monkeypatch.setenv("NPUMOE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(mechanism, "_chosen", {})
    return tmp_path / "cache"


@pytest.mark.usefixtures("own_cache")
@pytest.mark.parametrize("faster", ["fp32", "bf16"])
def test_with_room_auto_is_the_float_dtype_measured_faster(folder, faster, monkeypatch):
    timed = []

    def seconds(hidden, ffn, dtype):
        timed.append((hidden, ffn, str(dtype)))
        return 1e-3 if str(dtype).endswith({"fp32": "float32", "bf16": "bfloat16"}[faster]) else 2e-3

    monkeypatch.setattr(auto_weights, "expert_seconds", seconds)
    choice = choose_weights(folder, PLENTY)
    assert choice.weights == faster and "fastest float dtype" in choice.reason
    assert sorted(timed) == [(64, 32, "torch.bfloat16"), (64, 32, "torch.float32")]  # the checkpoint's expert sizes


@pytest.mark.usefixtures("own_cache")
@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])  # experts named w1/w2/w3; down stored (ffn, hidden)
def test_the_float_kernels_are_timed_at_the_experts_sizes_whatever_the_family_names_them(tiny, arch, monkeypatch):
    timed = []
    monkeypatch.setattr(auto_weights, "expert_seconds", lambda hidden, ffn, dtype: timed.append((hidden, ffn)) or 1.0)
    choose_weights(tiny(arch), PLENTY)
    assert timed == [(64, 32), (64, 32)]


def test_the_float_timings_are_measured_once_per_machine_then_read_from_the_cache(folder, own_cache, monkeypatch):
    timed = []

    def seconds(hidden, ffn, dtype):
        timed.append(str(dtype))
        return 1e-3 if dtype.itemsize == 2 else 2e-3

    monkeypatch.setattr(auto_weights, "expert_seconds", seconds)
    first = choose_weights(folder, PLENTY)
    assert first.weights == "bf16" and len(timed) == 2 and list(own_cache.glob("choices/*.json"))
    monkeypatch.setattr(mechanism, "_chosen", {})  # a new process
    assert choose_weights(folder, PLENTY) == first and len(timed) == 2  # the same choice, nothing timed again
    monkeypatch.setenv("NPUMOE_CACHE", str(own_cache.parent / "another"))  # another machine's cache: timed anew
    monkeypatch.setattr(mechanism, "_chosen", {})
    assert choose_weights(folder, PLENTY) == first and len(timed) == 4


@pytest.mark.usefixtures("own_cache")
def test_when_the_fastest_does_not_fit_auto_takes_the_first_smaller_format_that_does(folder, monkeypatch):
    monkeypatch.setattr(auto_weights, "expert_seconds", lambda hidden, ffn, dtype: 1.0 if dtype.itemsize == 2 else 0.5)
    size = model_size(checkpoint_tensors(folder))
    int8 = needed_bytes(size.formats["int8"].total_bytes)
    just_short_of_int8 = MIN_RESERVE_BYTES + int8 - 1
    choice = choose_weights(folder, just_short_of_int8)
    assert choice.weights == "int4" and "fp32, the fastest float dtype" in choice.reason and "fits" in choice.reason
    assert choose_weights(folder, MIN_RESERVE_BYTES + int8).weights == "int8"
    assert choose_weights(folder, MIN_RESERVE_BYTES + int8).fits
    nothing_fits = choose_weights(folder, MIN_RESERVE_BYTES)
    assert "does not fit either" in nothing_fits.reason and not nothing_fits.fits


def test_the_engine_decides_auto_at_load_measuring_here_and_says_so(folder, caplog):
    with caplog.at_level(logging.INFO, logger="npumoe.engine.api"):
        engine = Engine.load(EngineSettings(model=str(folder), weights="auto", chunk_tokens=128))
    assert engine.settings.weights in ("fp32", "bf16")  # the tiny model fits any machine that runs the tests
    assert engine.settings.dtype == {"fp32": "float32", "bf16": "bfloat16"}[engine.settings.weights]
    assert engine.loaded.model.dtype.itemsize == (4 if engine.settings.weights == "fp32" else 2)
    assert f"weights auto -> {engine.settings.weights}" in caplog.text and " ms" in caplog.text


@pytest.mark.usefixtures("own_cache")
# GraniteMoE checkpoints store their experts as block_sparse_moe.input_linear/output_linear (3-D, no `experts.`
# in the name); the shared variant has a shared MLP beside them
@pytest.mark.parametrize("arch", ["granitemoe", "granitemoeshared"])
def test_auto_reads_the_expert_sizes_from_the_model_whatever_the_checkpoint_names_them(tiny, orchard, arch,
                                                                                       monkeypatch):
    timed = []

    def seconds(hidden, ffn, dtype):
        timed.append((hidden, ffn))
        return 1e-3 if dtype.itemsize == 4 else 2e-3  # fp32 faster, so the engine is held to the fp32 forward

    monkeypatch.setattr(auto_weights, "expert_seconds", seconds)
    folder = tiny(arch)
    engine = Engine.load(EngineSettings(model=str(folder), weights="auto", overflow="spill", chunk_tokens=64))
    assert timed == [(64, 32), (64, 32)] and engine.settings.weights == "fp32"
    ids = list(orchard.encode())[:150]
    with torch.no_grad():
        want = load_model(folder).model(torch.tensor([ids])).logits[0]
    got = engine.logits(ids)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4
    assert engine.stats.layer_calls == 3 * 3  # the engine's experts ran: 3 chunks through 3 MoE layers
