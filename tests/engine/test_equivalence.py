"""The engine's logits equal the plain transformers forward (eager experts) on the same checkpoint.

For every family the tiny checkpoints cover, in fp32, within 1e-4 relative (max |engine - eager| / max |eager|),
for a prompt shorter than one chunk and one several chunks long: on the exact `cpu` backend, and on
`torch-static` with a tight plan and overflow `spill` (group graphs, cold experts and spills all used);
and the engine's experts implementation ran for each (its count of layer calls).
In bf16, where every forward rounds, the engine is held to transformers' own bf16 forward: no further
from the fp32 logits than that is.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from support.cpus import fake_timings

from npumoe.engine import Engine, EngineSettings, load_model
from npumoe.engine.calibration.calibrate import calibrate
from npumoe.engine.calibration.planner import make_plan
from npumoe.engine.kernels import bf16_linear
from npumoe.engine.moe.experts_layout import expert_weights
from npumoe.engine.moe.model_experts import moe_experts, moe_layouts
from npumoe.engine.plan.cost import CostModel
from npumoe.engine.plan.cost_cache import CostCache
from npumoe.engine.plan.residency import MeasuredCosts
from npumoe.engine.synthetic.tiny import ARCHITECTURES

CHUNK = 64
SHORT, LONG = 40, 5 * CHUNK + 17
# Launches nearly free: every group with any calibrated load goes on the accelerator.
ACCELERATOR_FAVOURED = CostModel(launch_s=1e-9, static_flops=1e15, cpu_call_s=1e-3, cpu_flops=1e9)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def make_plan_file(folder: Path, calibration_text: str, out: Path) -> Path:
    loaded = load_model(folder)
    calibration = calibrate(loaded, [("calibration", calibration_text)], chunk_tokens=CHUNK)
    plan = make_plan(calibration, model=loaded.name, model_key=loaded.key)
    # A quarter of the calibrated capacities, so that hot experts overflow and spill.
    plan = replace(plan, tiers=tuple(capacity // 4 for capacity in plan.tiers))
    plan.save(out)
    # Costs under which every group calibration saw load for runs as a graph, so the graphs are compared too.
    _, experts, layout = moe_layouts(loaded.model)[0]
    weights = expert_weights(experts, layout)
    CostCache(out.parent / "costs").put("torch-static", plan,
                                        MeasuredCosts(ACCELERATOR_FAVOURED, weights.hidden, weights.ffn, "test"))
    return out


@pytest.fixture(scope="module")
def prompts(orchard: str) -> dict[str, list[int]]:
    ids = list(orchard.encode())  # the byte tokenizer: one token per byte
    return {"short": ids[:SHORT], "long": ids[:LONG]}


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_engine_logits_equal_eager_transformers_on_every_backend(tiny, tmp_path, harbour, prompts, arch):
    folder = tiny(arch)
    reference = load_model(folder).model
    plan = make_plan_file(folder, harbour, tmp_path / "plan.json")
    engines = {
        # the exact paths against the fp32 reference: pinned, since weights auto may choose bf16 here
        "cpu": Engine.load(EngineSettings(model=str(folder), chunk_tokens=CHUNK, weights="fp32")),
        "torch-static": Engine.load(EngineSettings(model=str(folder), backend="torch-static", plan=plan, weights="fp32",
                                                   costs_dir=tmp_path / "costs")),
    }
    static_work = spilled = 0
    for name, ids in prompts.items():
        with torch.no_grad():
            want = reference(torch.tensor([ids])).logits[0]
        for backend, engine in engines.items():
            got = engine.logits(ids)
            assert got.shape == want.shape
            assert relative_error(got, want) < 1e-4, f"{backend}, {name} prompt"
            # the engine's experts implementation ran: once per MoE layer per chunk, with every assignment
            assert engine.stats.layer_calls == math.ceil(len(ids) / CHUNK) * 3
            assert engine.stats.assignments == len(ids) * reference.config.num_experts_per_tok * 3
        static_work += engines["torch-static"].stats.static
        spilled += engines["torch-static"].stats.spilled
    assert static_work > 0 and spilled > 0  # the comparison covered group graphs and spills


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_experts_move_the_logits_well_beyond_the_tolerance(tiny, prompts, arch):
    """Without this the equivalence above could pass with experts that barely matter."""
    model = load_model(tiny(arch)).model
    ids = torch.tensor([prompts["long"]])
    with torch.no_grad():
        want = model(ids).logits[0]
        for _, experts in moe_experts(model):
            experts.down_proj.zero_()
        without_experts = model(ids).logits[0]
    assert relative_error(without_experts, want) > 1e-2


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_in_bf16_the_engine_is_as_close_to_fp32_as_transformers_own_bf16_forward(tiny, prompts, arch, tmp_path,
                                                                                   monkeypatch):
    folder = tiny(arch)
    ids = torch.tensor([prompts["long"]])
    with torch.no_grad():
        exact = load_model(folder).model(ids).logits[0]
        eager_bf16 = load_model(folder, dtype="bfloat16").model(ids).logits[0].float()
    engine_kernel = bf16_linear.unavailable() is None
    if engine_kernel:  # the measured choice could go either way: let the engine's kernel win, to run end to end
        fake_timings(monkeypatch, tmp_path, fastest="npumoe-bf16")
    engine = Engine.load(EngineSettings(model=str(folder), chunk_tokens=CHUNK, dtype="bfloat16"))
    if engine_kernel:
        assert {layer.experts.kernel for layer in engine.runtime.layers} == {"npumoe-bf16"}
    got = engine.logits(prompts["long"]).float()
    # bf16 rounding alone moves these tiny random models' logits by 3-60%; a wrong expert would add to that
    assert relative_error(got, exact) <= 1.25 * relative_error(eager_bf16, exact)
