"""Dense GGUF models (llama, Mistral as llama.cpp writes it, qwen2, qwen3, gemma3): each loads as transformers reads
the same file and runs through the engine (its attention, projections and norms; no experts to route), and a plan
or a static backend, which have nothing to place in a dense model, is refused in one line."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from support.gguf_logits import logits, reference_logits
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from npumoe.engine import api
from npumoe.engine.attach import runtime as engine_runtime
from npumoe.engine.attach.runtime import MoeRuntime, dense_refusal
from npumoe.engine.backends.registry import get_backend
from npumoe.engine.calibration.calibrate import calibrate
from npumoe.engine.errors import ModelError
from npumoe.engine.generate.checks import checked
from npumoe.engine.loading.gguf_load import gguf_config, gguf_model
from npumoe.engine.loading.load import LoadedModel
from npumoe.engine.plan.expert_plan import ExpertPlan
from npumoe.engine.synthetic.gguf_writer import write_model_gguf

Q = gguf.GGMLQuantizationType
_SIZES = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False)
CONFIGS: dict[str, PretrainedConfig] = {
    "llama": LlamaConfig(**_SIZES),
    "mistral": MistralConfig(**_SIZES, sliding_window=None),
    "qwen2": Qwen2Config(**_SIZES),
    "qwen3": Qwen3Config(**_SIZES),
    "gemma3": Gemma3TextConfig(**_SIZES, sliding_window=16, query_pre_attn_scalar=16),
}


def _written(arch: str, folder: Path, qtype: gguf.GGMLQuantizationType) -> Path:
    """A tiny random model of `arch` as the GGUF file llama.cpp would write for it (no tokenizer: token ids only)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[arch])
    for name, parameter in model.named_parameters():
        if name.endswith("norm.weight"):  # norms away from their initial ones and zeros, so that gemma's 1 + w shows
            parameter.data.uniform_(0.5, 1.5)
    return write_model_gguf(model, None, folder / f"{arch}.gguf", weights=qtype)




@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0])
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_a_dense_gguf_loads_as_transformers_reads_it_and_runs_through_the_engine(tmp_path, arch, qtype,
                                                                                  monkeypatch):
    file = _written(arch, tmp_path, qtype)
    # llama.cpp writes Mistral as llama, and transformers reads it back as one (the same computation without a
    # sliding window)
    assert type(gguf_config(file)) is type(CONFIGS["llama" if arch == "mistral" else arch])
    model = gguf_model(file, torch.float32, experts_implementation="eager")
    reference = reference_logits(file)
    assert (logits(model) - reference).abs().max() < 1e-4
    runtimes: list[MoeRuntime] = []
    monkeypatch.setattr(engine_runtime, "DenseProjections", _spy(engine_runtime.DenseProjections, runtimes))
    runtime = MoeRuntime(model, get_backend("cpu"), release=True)
    assert runtime.layers == [] and len(runtimes) == 1  # no experts: attention, projections and norms only
    error = (logits(model) - reference).norm() / reference.norm()
    assert error < 1e-4  # fp32 projections: the engine's kernels sum in another order
    runtime.detach()


def _spy(cls: type, made: list) -> type:
    """`cls`, counting the instances made in `made`."""
    class Counted(cls):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)
    return Counted


def _plan() -> ExpertPlan:
    return ExpertPlan(model="model.gguf", model_key="model.gguf@0", chunk_tokens=64, group_size=4, tiers=(8,),
                      calibration_tokens=0, calibration_chunks=0, sources=(), layers=())


def test_a_dense_model_with_a_plan_is_refused_in_one_line_naming_why(tmp_path):
    model = gguf_model(_written("qwen3", tmp_path, Q.F16), torch.float32, experts_implementation="eager")
    with pytest.raises(ModelError, match=r"^Qwen3ForCausalLM is a dense model: an expert plan has no experts to "
                                         r"place in it .*run it without a plan on the cpu backend$"):
        MoeRuntime(model, get_backend("cpu"), _plan())


def test_the_engine_refuses_a_plan_for_a_dense_model_before_placing_anything(tmp_path, monkeypatch):
    file = _written("llama", tmp_path, Q.F16)
    loaded = LoadedModel(model=gguf_model(file, torch.float32, experts_implementation="eager"), tokenizer=None,
                         name="llama.gguf", path=file, key="llama.gguf@0")
    placed: list[object] = []
    monkeypatch.setattr(api, "place", lambda *args: placed.append(args))
    with pytest.raises(ModelError, match=r"^llama\.gguf: LlamaForCausalLM is a dense model: an expert plan"):
        api.Engine(api.EngineSettings(model=str(file)), loaded, _plan())
    assert placed == []


def test_a_check_runs_before_every_decoder_layer_of_a_dense_model(tmp_path):
    model = gguf_model(_written("qwen3", tmp_path, Q.F16), torch.float32, experts_implementation="eager")
    calls: list[None] = []
    with checked(model, lambda: calls.append(None)):
        logits(model)
    assert len(calls) == CONFIGS["qwen3"].num_hidden_layers
    logits(model)
    assert len(calls) == CONFIGS["qwen3"].num_hidden_layers  # the hooks went with the block


def test_calibrating_a_dense_model_is_refused_saying_it_has_no_experts(tmp_path):
    model = gguf_model(_written("llama", tmp_path, Q.F16), torch.float32, experts_implementation="eager")
    loaded = LoadedModel(model=model, tokenizer=None, name="llama.gguf", path=tmp_path, key="llama.gguf@0")
    with pytest.raises(ModelError, match=r"LlamaForCausalLM has no routed-experts modules .*a dense model"):
        calibrate(loaded, [("text", "some words")])


def test_a_static_backend_for_a_dense_model_is_refused_naming_it_and_the_cpu_path_is_not():
    model = AutoModelForCausalLM.from_config(CONFIGS["llama"])
    assert dense_refusal(model, "coreml", static=True, planned=False) == (
        "LlamaForCausalLM is a dense model: the coreml backend, which runs planned expert groups as graphs, has no "
        "experts to place in it (its FFN is one expert every token takes, run on the CPU path); run it without a "
        "plan on the cpu backend")
    assert dense_refusal(model, "cpu", static=False, planned=False) is None
