"""The engine's RMSNorm kernel in place of transformers' modules: it computes each known class's output (float32
within summation order; bfloat16 on all but a few elements exactly, see `assert_same_as_module`), runs where it says
it does, leaves what it does not take to the module, and attach/detach swap the modules in and out."""

from __future__ import annotations

import importlib
import platform

import pytest
import torch
from torch import nn

from npumoe.engine.attach import norms
from npumoe.engine.attach.norms import CONVENTIONS, EngineNorms, EngineRMSNorm, model_norms
from npumoe.engine.attach.runtime import MoeRuntime
from npumoe.engine.backends.registry import get_backend
from npumoe.engine.kernels import norm_kernel
from npumoe.engine.kernels.norm_kernel import CAST_FIRST, WEIGHT_FIRST
from npumoe.engine.loading.load import load_model

needs_kernel = pytest.mark.skipif(norm_kernel.unavailable() is not None,
                                  reason=f"the norm kernel cannot run here: {norm_kernel.unavailable()}")

# (leading shape, width): a model's hidden rows, 4-D per-head rows (B, T, heads, D), and widths with masked tails
SHAPES = [((3, 37), 2048), ((2, 9, 4), 128), ((11,), 72), ((2, 5), 100), ((4,), 7)]


def norm_class(qualified: str) -> type[nn.Module]:
    module, _, name = qualified.rpartition(".")
    return getattr(importlib.import_module(module), name)


def random_norm(cls: type[nn.Module], width: int, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    norm = cls(width).to(dtype)
    with torch.no_grad():  # a trained norm's weight, not its initial ones or zeros
        norm.weight.copy_(1 + 0.5 * torch.randn(width, generator=torch.Generator().manual_seed(seed)))
    return norm


def assert_same_as_module(got: torch.Tensor, want: torch.Tensor, mode: int = CAST_FIRST) -> None:
    """float32: within 1e-6. bfloat16: the order of the sum of squares moves 1/rms by an ulp of float32 now and
    then, which decides a rounding only where a value sits on a bf16 midpoint: one ulp of the output; where the
    module rounds before the weight, that ulp of the normalised value is scaled by the weight: up to two."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        return
    ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert int(ulps.max()) <= (2 if mode == CAST_FIRST else 1)
    assert float((ulps > 0).float().mean()) <= 1e-3


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qualified", sorted(CONVENTIONS))
def test_the_kernel_computes_each_known_classs_output(qualified, dtype):
    generator = torch.Generator().manual_seed(1)
    for leading, width in SHAPES:
        module = random_norm(norm_class(qualified), width, dtype)
        engine = EngineRMSNorm(module)
        x = (3 * torch.randn(*leading, width, generator=generator)).to(dtype)
        with torch.inference_mode():
            got, want = engine(x), module(x)
        assert engine.calls == 1, (leading, width)
        assert_same_as_module(got, want, engine.mode)


@needs_kernel
def test_rounding_before_or_after_the_weight_is_the_classs_own():
    # the two conventions differ in bf16 on many elements: each class is held to its own, not to the other's
    x = (3 * torch.randn(64, 2048, generator=torch.Generator().manual_seed(2))).bfloat16()
    llama = random_norm(norm_class("transformers.models.llama.modeling_llama.LlamaRMSNorm"), 2048, torch.bfloat16)
    gpt_oss = random_norm(norm_class("transformers.models.gpt_oss.modeling_gpt_oss.GptOssRMSNorm"), 2048,
                          torch.bfloat16)
    with torch.inference_mode():
        assert not torch.equal(llama(x), gpt_oss(x))
        assert_same_as_module(EngineRMSNorm(llama)(x), llama(x))
        assert_same_as_module(EngineRMSNorm(gpt_oss)(x), gpt_oss(x), WEIGHT_FIRST)


@needs_kernel
def test_bf16_rounded_on_the_integer_bits_equals_the_cpus_conversion_and_the_module():
    module = random_norm(norm_class("transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeRMSNorm"), 100,
                         torch.bfloat16)
    x = (3 * torch.randn(50, 100, generator=torch.Generator().manual_seed(3))).bfloat16()
    x[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])  # a row of specials stays NaN
    engine = EngineRMSNorm(module)
    emulated = norm_kernel.rms_norm(x, engine.scale, engine.eps, CAST_FIRST, torch.empty_like(x), native_bf16=False)
    with torch.inference_mode():
        want = module(x)
    assert bool(emulated[0].isnan().all()) and bool(want[0].isnan().all())
    assert_same_as_module(emulated[1:], want[1:])
    if torch.cpu._is_avx512_bf16_supported():
        native = norm_kernel.rms_norm(x, engine.scale, engine.eps, CAST_FIRST, torch.empty_like(x), native_bf16=True)
        assert torch.equal(native[1:], emulated[1:])


@needs_kernel
def test_a_weight_changed_in_place_is_the_one_the_kernel_scales_by():
    module = random_norm(norm_class("transformers.models.olmoe.modeling_olmoe.OlmoeRMSNorm"), 72, torch.bfloat16)
    engine = EngineRMSNorm(module)
    x = torch.randn(4, 72, generator=torch.Generator().manual_seed(6)).bfloat16()
    module.load_state_dict({"weight": 2 * module.weight.detach()})  # copies into the same parameter
    with torch.inference_mode():
        got, want = engine(x), module(x)
    assert engine.calls == 1
    assert_same_as_module(got, want)


@needs_kernel
def test_strided_rows_run_in_the_kernel_and_strided_elements_in_the_module():
    module = random_norm(norm_class("transformers.models.mixtral.modeling_mixtral.MixtralRMSNorm"), 128,
                         torch.bfloat16)
    engine = EngineRMSNorm(module)
    wide = torch.randn(6, 10, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    rows = wide[:, ::2, 64:192]  # rows apart from each other, elements adjacent
    columns = wide[:, :, :128].transpose(1, 2).contiguous().transpose(1, 2)  # (6, 10, 128), elements 10 apart
    with torch.inference_mode():
        assert_same_as_module(engine(rows), module(rows))
        assert engine.calls == 1
        assert torch.equal(engine(columns), module(columns))
        assert engine.calls == 1


@needs_kernel
def test_what_the_kernel_does_not_take_runs_in_the_module():
    cast_first = norm_class("transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeRMSNorm")
    # a float32 weight over bf16 rows: the module's product would be float32, not the input's dtype
    wider = EngineRMSNorm(random_norm(cast_first, 64, torch.float32))
    half = EngineRMSNorm(random_norm(cast_first, 64, torch.float16))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        assert wider(x.bfloat16()).dtype == torch.float32
        assert half(x.half()).dtype == torch.float16
    trained = EngineRMSNorm(random_norm(cast_first, 64, torch.float32))
    y = trained(x.requires_grad_())  # autograd: the module's own operations
    y.sum().backward()
    assert x.grad is not None
    assert wider.calls == half.calls == trained.calls == 0
    with torch.inference_mode():  # a weight-first class takes a float32 weight over bf16 rows, as gpt-oss's
        weight_first = random_norm(norm_class("transformers.models.deepseek_v4.modeling_deepseek_v4."
                                              "DeepseekV4RMSNorm"), 64, torch.float32)
        engine = EngineRMSNorm(weight_first)
        assert_same_as_module(engine(x.bfloat16()), weight_first(x.bfloat16()), WEIGHT_FIRST)
        assert engine.calls == 1


def test_only_the_known_classes_themselves_are_taken():
    known = norm_class("transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeRMSNorm")

    class Subclass(known):  # may compute otherwise
        pass

    for other in (Subclass(8), nn.LayerNorm(8)):
        assert norms.convention(other) is None
        with pytest.raises(ValueError, match="does not reproduce"):
            EngineRMSNorm(other)


def test_the_models_norms_are_its_layers_and_final_norm_and_not_the_experts(tiny):
    model = load_model(tiny("qwen3_moe")).model
    names = [name for name, _ in model_norms(model)]
    leaves = {name.rsplit(".", 1)[1] for name in names}
    assert leaves == {"input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", "norm"}
    assert len(names) == 4 * model.config.num_hidden_layers + 1


@needs_kernel
def test_attach_runs_the_kernel_and_detach_puts_the_modules_back(tiny):
    model = load_model(tiny("qwen3_moe")).model
    originals = {name: slot.original for name, slot in model_norms(model)}
    ids = torch.tensor([list(range(1, 60))])
    with torch.inference_mode():
        runtime = MoeRuntime(model, get_backend("cpu"))
        swapped = {name: model.get_submodule(name) for name in originals}
        got = model(ids).logits
        other = MoeRuntime(model, get_backend("cpu"))  # a second runtime takes the originals, not the first's norms
        assert all(model.get_submodule(name).original is original for name, original in originals.items())
        assert all(model.get_submodule(name) is not swapped[name] for name in originals)
        other.detach()
        runtime.attach()
        again = model(ids).logits
        runtime.detach()
        back = {name: model.get_submodule(name) for name in originals}
        want = model(ids).logits
    assert all(isinstance(m, EngineRMSNorm) and m.original is originals[name] for name, m in swapped.items())
    # model code reading a norm's attributes sees the original's (Nemotron-H casts to the norm weight's dtype)
    assert all(m.weight is originals[name].weight and m.variance_epsilon == originals[name].variance_epsilon
               for name, m in swapped.items())
    assert all(m.calls == 2 for m in swapped.values())  # each norm ran in the kernel in both forward passes
    assert all(back[name] is original for name, original in originals.items())
    assert torch.equal(got, again)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4


def test_the_kernel_says_why_it_cannot_run_on_another_cpu(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "arm64")
    assert norm_kernel.unsupported_cpu() == "the norm kernel is for x86-64 CPUs, this is arm64"
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert norm_kernel.unsupported_cpu() == "this CPU lacks AVX-512"


def test_where_the_kernel_cannot_run_the_modules_stay_and_say_why(tiny, monkeypatch):
    monkeypatch.setattr(norm_kernel, "unavailable", lambda: "this CPU lacks AVX-512")
    model = load_model(tiny("qwen3_moe")).model
    originals = {name: slot.original for name, slot in model_norms(model)}
    held = EngineNorms(model)
    assert held.unavailable == "this CPU lacks AVX-512" and held.slots == []
    runtime = MoeRuntime(model, get_backend("cpu"))
    assert runtime._norms.unavailable == "this CPU lacks AVX-512"
    assert all(model.get_submodule(name) is original for name, original in originals.items())
