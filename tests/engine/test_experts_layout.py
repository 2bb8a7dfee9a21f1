"""Experts layouts read off transformers' own experts classes, and the engine's layer equal to each class's
eager forward: exact CPU path, group graphs and spills. Layouts the engine does not implement are refused
in one line naming the module, its class and what is missing."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn
from transformers import AutoConfig
from transformers.activations import ACT2FN
from transformers.integrations.moe import use_experts_implementation
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.hy_v4.modeling_hy_v4 import HYV4Experts
from transformers.models.muse_spark.modeling_muse_spark import MuseSparkExperts
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts
from transformers.models.openai_privacy_filter.modeling_openai_privacy_filter import OpenAIPrivacyFilterExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from npumoe.engine.backends.registry import get_backend
from npumoe.engine.moe.dispatch import DispatchStats, MoeLayer, StaticGroup
from npumoe.engine.moe.experts_layout import LayoutError, expert_weights, read_layout

HIDDEN, FFN, EXPERTS, TOKENS, TOP_K = 32, 16, 8, 40, 2

# model type: (its experts class, config settings, the layout the engine reads off it)
CLASSES = {
    "qwen3_moe": (Qwen3MoeExperts, dict(num_experts=EXPERTS, moe_intermediate_size=FFN), "silu glu"),
    "gpt_oss": (GptOssExperts, dict(num_local_experts=EXPERTS, intermediate_size=FFN, swiglu_limit=1.0),
                "clamped-swiglu(alpha=1.702, limit=1.0), biases"),
    "openai_privacy_filter": (OpenAIPrivacyFilterExperts, dict(num_local_experts=EXPERTS, intermediate_size=FFN,
                                                               swiglu_limit=1.0),
                              "clamped-swiglu(alpha=1.702, limit=1.0), biases"),
    "deepseek_v4": (DeepseekV4Experts, dict(num_local_experts=EXPERTS, intermediate_size=FFN, swiglu_limit=1.0),
                    "silu clamped-glu(limit=1.0)"),
    "hy_v4": (HYV4Experts, dict(num_local_experts=EXPERTS, moe_intermediate_size=FFN, swiglu_limit=1.0),
              "silu clamped-glu(limit=1.0)"),
    "gemma4_text": (Gemma4TextExperts, dict(num_experts=EXPERTS, moe_intermediate_size=FFN, enable_moe_block=True,
                                            top_k_experts=TOP_K), "gelu_pytorch_tanh glu"),
    "nemotron_h": (NemotronHExperts, dict(n_routed_experts=EXPERTS, moe_intermediate_size=FFN), "relu2, not gated"),
    "muse_spark_text": (MuseSparkExperts, dict(num_local_experts=EXPERTS, moe_hidden_size=HIDDEN,
                                               moe_intermediate_size=FFN, num_attention_heads=4),
                        "silu glu, post-expert norm"),
}


def experts_module(model_type: str) -> nn.Module:
    """The model type's experts class at a tiny size, every weight random (biases and norms included)."""
    experts_class, settings, _ = CLASSES[model_type]
    config = AutoConfig.for_model(model_type, hidden_size=HIDDEN, **settings)
    config._experts_implementation = "eager"
    module = experts_class(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in module.named_parameters():
            scale = 0.1 if name.endswith("bias") or param.ndim == 1 else param.shape[-1] ** -0.5
            param.copy_(torch.randn(param.shape, generator=generator) * scale + (param.ndim == 1 and "norm" in name))
    return module


def routing(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, top_k_index, top_k_weights): tokens large enough to reach past the clamps, a skewed top-2 routing."""
    x = torch.randn(TOKENS, HIDDEN, generator=generator) * 3
    logits = torch.randn(TOKENS, EXPERTS, generator=generator) + torch.linspace(3, 0, EXPERTS)
    weights, index = torch.topk(logits.softmax(-1), TOP_K, dim=-1)
    return x, index, weights


@pytest.mark.parametrize("model_type", list(CLASSES))
def test_the_engines_layer_equals_the_experts_class_eager_forward(model_type):
    module = experts_module(model_type)
    layout = read_layout("model.layers.0.mlp.experts", module)
    assert layout.describe() == CLASSES[model_type][2]
    x, index, weights = routing(torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = module(x, index, weights)
    experts = expert_weights(module, layout)
    backend = get_backend("torch-static")
    groups = [StaticGroup((0, 1), 4, backend.build_group(experts.select((0, 1)), layout, 4)),  # the hot ones spill
              StaticGroup((5,), 8, backend.build_group(experts.select((5,)), layout, 8))]
    layer = MoeLayer(experts, layout, groups=groups, post_norm=getattr(module, "post_expert_norm", None))
    stats = DispatchStats()
    with torch.no_grad():
        exact, planned = layer.exact(x, index, weights), layer(x, index, weights, stats)
    torch.testing.assert_close(exact, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(planned, want, rtol=1e-5, atol=1e-5)
    assert stats.static > 0 and stats.spilled > 0 and stats.cpu > 0


@use_experts_implementation
class SquaredUpExperts(nn.Module):
    """A gate the engine does not implement: act(gate) * up²."""

    def __init__(self, config) -> None:
        super().__init__()
        self.num_experts = EXPERTS
        self.gate_up_proj = nn.Parameter(torch.zeros(EXPERTS, 2 * FFN, HIDDEN))
        self.down_proj = nn.Parameter(torch.zeros(EXPERTS, HIDDEN, FFN))
        self.act_fn = ACT2FN["silu"]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        raise NotImplementedError  # never run: the layout is refused first

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up * up


def test_a_gate_the_engine_does_not_implement_is_refused_in_one_line_naming_the_module_and_class():
    with pytest.raises(LayoutError) as refused:
        read_layout("model.layers.3.mlp.experts", SquaredUpExperts(AutoConfig.for_model("qwen3_moe")))
    assert str(refused.value) == (
        "model.layers.3.mlp.experts (SquaredUpExperts): its _apply_gate (activation SiLUActivation) computes a "
        "gating function the engine does not implement (it implements glu, clamped-glu, clamped-swiglu)")


def test_a_module_outside_the_experts_interface_is_refused():
    module = nn.Module()
    module.num_experts = EXPERTS
    module.gate_up_proj = nn.Parameter(torch.zeros(EXPERTS, HIDDEN, 2 * FFN))
    with pytest.raises(LayoutError, match=r"^m \(Module\): not wrapped by transformers' experts interface"):
        read_layout("m", module)


def test_declared_biases_that_are_missing_are_refused():
    module = SquaredUpExperts(AutoConfig.for_model("qwen3_moe"))
    module.has_bias = True
    with pytest.raises(LayoutError, match=r"declares biases but has no gate_up_proj_bias and down_proj_bias"):
        read_layout("m", module)


def test_making_transformers_activations_prints_no_notice_to_the_person():
    # In a process of its own: transformers prints each notice once per process, so one this suite's other tests
    # caused would hide it here. Recognising a model's activation makes every named one, xIELU's among them.
    script = ("from transformers.activations import ACT2CLS\n"
              "from npumoe.engine.moe.experts_layout import activation\n"
              "print(sum(activation(name) is not None for name in ACT2CLS), type(activation('xielu')).__name__)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    made, kind = done.stdout.split()
    assert kind == "XIELUActivation" and int(made) > 10
    assert "xIELU" not in done.stderr and "pip install" not in done.stderr, done.stderr
