"""With a plan, the experts are loaded packed and a placed group runs over that one copy of its weights."""

from __future__ import annotations

import torch

from npumoe.engine import Engine, EngineSettings
from npumoe.engine.calibration.planner import calibrate_plan
from npumoe.engine.moe import cpu_experts
from npumoe.engine.moe.experts_layout import ExpertWeights
from npumoe.engine.moe.grouped import PackedGroup
from npumoe.engine.moe.model_experts import expert_layouts
from npumoe.engine.moe.release import is_placeholder, placeholder, released


def test_a_quantized_gguf_with_a_plan_loads_its_experts_packed_and_its_groups_run_over_them(
        tiny_gguf, harbour, orchard, tmp_path, monkeypatch) -> None:
    file = tiny_gguf("qwen3_moe", "Q4_0")
    calibrate_plan(str(file), [("harbour", harbour)], tmp_path / "plan.json", chunk_tokens=128)
    streamed = []  # each experts module the loader packs as it reads it
    real = cpu_experts.CpuExperts.streamed.__func__

    def counted(cls, *args, **kwargs):
        streamed.append(kwargs.get("format", args[3] if len(args) > 3 else None))
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(cpu_experts.CpuExperts, "streamed", classmethod(counted))
    engine = Engine.load(EngineSettings(model=str(file), backend="torch-static", plan=tmp_path / "plan.json",
                                        costs_dir=tmp_path / "costs", weights="int4", residency="accelerator"))
    modules = expert_layouts(engine.loaded.model)
    assert streamed == ["int4"] * len(modules)  # packed as they were read, never held in float
    for _, module, layout in modules:
        assert released(module) and all(is_placeholder(getattr(module, name)) for name in layout.weight_names)
    graphs = [(group.graph, layer) for layer in engine.runtime.layers for group in layer.groups]
    assert graphs  # the accelerator policy placed the plan's groups
    # a placed group holds no weights of its own: its graph reads the layer's packed copy, the CPU path's
    assert all(isinstance(graph, PackedGroup) and graph.experts is layer.experts for graph, layer in graphs)
    assert {layer.experts.format for layer in engine.runtime.layers} == {"int4"}
    engine.logits(engine.loaded.tokenizer(orchard)["input_ids"][:200])
    assert engine.stats.static > 0 and sum(graph.calls for graph, _ in graphs) > 0
    engine.close()


def test_the_experts_of_released_weights_select_as_placeholders_not_copies() -> None:
    weights = ExpertWeights(placeholder(torch.empty(8, 64, 32)), placeholder(torch.empty(8, 32, 32)))
    chosen = weights.select([5, 1, 2])
    assert tuple(chosen.gate_up.shape) == (3, 64, 32) and tuple(chosen.down.shape) == (3, 32, 32)
    assert is_placeholder(chosen.gate_up) and is_placeholder(chosen.down)
    real = ExpertWeights(torch.randn(4, 6, 3), torch.randn(4, 3, 3))
    torch.testing.assert_close(real.select([2, 0]).gate_up, real.gate_up[[2, 0]])
