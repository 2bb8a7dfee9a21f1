"""The dense projections outside the experts: which the engine takes, that float ones compute torch's linear,
that the measured choice decides (float, quantized, or the Linear left alone), and one copy of each weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.cpus import fake_projection_timings
from torch import nn

from npumoe.engine.attach import projections
from npumoe.engine.attach.projections import ProjectionLinear, dense_projections, projection_for
from npumoe.engine.attach.runtime import MoeRuntime
from npumoe.engine.backends.registry import get_backend
from npumoe.engine.formats.quantize import INT8, quantize, relative_error
from npumoe.engine.kernels import choice as mechanism
from npumoe.engine.kernels import float_kernels, quant_kernels, vnni_linear
from npumoe.engine.kernels.float_kernels import PackedLinear
from npumoe.engine.kernels.quant_kernels import QuantLinear
from npumoe.engine.loading.load import load_model

FLOAT_KERNELS = [kernel for kernel in float_kernels.KERNELS if kernel != "torch"]


@pytest.fixture
def timed_fastest(monkeypatch, tmp_path):
    """fastest(kernel): the projections' timing finds `kernel` the fastest, nothing chosen yet, a private cache."""
    return lambda kernel: fake_projection_timings(monkeypatch, tmp_path / "cache", kernel)


def counted_multiplies(monkeypatch) -> list[str]:
    """The kernels `ProjectionLinear.forward` ran, in call order."""
    ran: list[str] = []
    multiply = projections.multiply

    def counted(kernel, linear, x, out_features):
        ran.append(kernel)
        return multiply(kernel, linear, x, out_features)

    monkeypatch.setattr(projections, "multiply", counted)
    return ran


def runnable(kernel: str, dtype: torch.dtype, n: int, k: int) -> bool:
    return kernel not in float_kernels.unavailable_kernels(torch.empty(n, k, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", FLOAT_KERNELS)
def test_a_float_projection_computes_torchs_linear(monkeypatch, kernel, dtype):
    n, k = 128, 96
    if not runnable(kernel, dtype, n, k):
        pytest.skip(f"{kernel} cannot run {dtype} here")
    generator = torch.Generator().manual_seed(0)
    linear = nn.Linear(k, n, dtype=dtype)
    x = torch.randn(2, 37, k, generator=generator).to(dtype)  # rows not a multiple of the workers' split
    projection = ProjectionLinear(linear, PackedLinear(linear.weight.detach(), kernel), kernel, None)
    ran = counted_multiplies(monkeypatch)
    with torch.inference_mode():
        got, want = projection(x), F.linear(x, linear.weight, linear.bias)
    assert ran == [kernel]
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got, want, **({} if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)))


def test_the_engines_own_kernels_split_the_rows_over_the_workers(threads):
    if (why := vnni_linear.unavailable()) is not None:
        pytest.skip(why)
    linear = nn.Linear(128, 64)
    quantized = QuantLinear.from_float(linear.weight.detach(), "int8", "npumoe-int8-dynamic")
    calls: list[int] = []

    def counted(x, out=None):
        calls.append(x.shape[0])
        return QuantLinear.__call__(quantized, x, out)

    x = torch.randn(40, 128)
    with torch.inference_mode():
        got = projections.multiply("npumoe-int8-dynamic", counted, x, 64)
        want = quantized(x)
    assert calls == [32, 8]  # split in whole tiles of 16 rows
    torch.testing.assert_close(got, want)
    assert projections.multiply("npumoe-int8-dynamic", counted, x[:0], 64).shape == (0, 64)


def test_the_dense_projections_are_attentions_dense_ffns_and_shared_experts_not_routers_experts_or_the_head(tiny):
    model = load_model(tiny("qwen2_moe")).model  # shared experts, with a gate of their own beside the router
    names = [name for name, _ in dense_projections(model)]
    leaves = {name.rsplit(".", 1)[1] for name in names}
    assert leaves == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert all(".shared_expert." in name for name in names if name.endswith(("gate_proj", "up_proj", "down_proj")))
    assert not any(name.startswith("lm_head") or name.endswith(("mlp.gate", "shared_expert_gate")) for name in names)
    assert len(names) == model.config.num_hidden_layers * 7


def test_attach_puts_the_chosen_projections_in_and_detach_puts_the_linears_back(tiny, timed_fastest):
    timings = timed_fastest("onednn")
    if not runnable("onednn", torch.float32, 64, 64):
        pytest.skip("oneDNN's packed matmul cannot run here")
    loaded = load_model(tiny("qwen3_moe"))
    model = loaded.model
    originals = {name: slot.original for name, slot in dense_projections(model)}
    ids = torch.tensor([list(range(1, 60))])
    with torch.inference_mode():
        want = model(ids).logits
        runtime = MoeRuntime(model, get_backend("cpu"))
        swapped = {name: model.get_submodule(name) for name in originals}
        got = model(ids).logits
        runtime.detach()
        back = {name: model.get_submodule(name) for name in originals}
    assert len(timings.calls) >= 1
    assert all(isinstance(m, ProjectionLinear) and m.kernel == "onednn" for m in swapped.values())
    assert all(back[name] is original for name, original in originals.items())
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4


def test_where_torch_measures_fastest_the_linear_stays(tiny, timed_fastest):
    timings = timed_fastest("torch")
    model = load_model(tiny("qwen3_moe")).model
    before = {name: model.get_submodule(name) for name, _ in dense_projections(model)}
    MoeRuntime(model, get_backend("cpu"))
    if float_kernels.unavailable_kernels(next(iter(before.values())).weight).keys() >= {"onednn", "npumoe-bf16"}:
        assert len(timings.calls) == 0  # nothing to compare: torch is all that runs here
    else:
        assert len(timings.calls) >= 1
    assert all(model.get_submodule(name) is linear for name, linear in before.items())


def test_a_quantized_kernel_runs_a_projection_only_where_it_measures_faster_than_float(timed_fastest):
    linear = nn.Linear(128, 64)
    timed_fastest("int8pack")  # torch's weight-only int8: runs everywhere
    quantized = projection_for(linear, "int8")
    assert isinstance(quantized.linear, QuantLinear) and quantized.format == "int8"
    assert quantized.weight_nbytes < linear.weight.nbytes
    x = torch.randn(24, 128)
    with torch.inference_mode():
        error = float((quantized(x) - linear(x)).norm() / linear(x).norm())
    assert 0 < error < 0.01

    float_kernel = next((k for k in FLOAT_KERNELS if runnable(k, torch.float32, 128, 128)), None)
    if float_kernel is None:
        pytest.skip("no float kernel but torch runs here")
    other = nn.Linear(128, 128)  # another shape: a choice of its own
    timed_fastest(float_kernel)
    kept_float = projection_for(other, "int8")
    assert isinstance(kept_float.linear, PackedLinear) and kept_float.format is None


def test_beside_int4_experts_a_projection_is_quantized_to_int8_at_most(timed_fastest):
    timings = timed_fastest("int8pack")
    projection = projection_for(nn.Linear(128, 64), "int4")
    assert isinstance(projection.linear, QuantLinear) and projection.format == "int8"
    (candidates,) = timings.calls
    assert "int8pack" in candidates
    assert not set(candidates) & set(quant_kernels.KERNELS["int4"])


def test_released_projections_hold_the_one_copy_and_refuse_another_format(tiny, timed_fastest):
    timed_fastest("int8pack")
    model = load_model(tiny("qwen3_moe")).model
    name, slot = dense_projections(model)[0]
    weight_bytes = slot.original.weight.untyped_storage().nbytes()
    runtime = MoeRuntime(model, get_backend("cpu"), quantized="int8", release=True)
    projection = model.get_submodule(name)
    assert isinstance(projection, ProjectionLinear) and projection.format == "int8"
    assert slot.original.weight.untyped_storage().nbytes() < weight_bytes  # a placeholder over one element
    assert slot.original.weight.shape == (slot.original.out_features, slot.original.in_features)
    assert MoeRuntime(model, get_backend("cpu"), quantized="int8").layers  # the same format: the same packed copy
    assert model.get_submodule(name) is projection
    runtime.attach()
    with pytest.raises(ValueError, match="projection's weight was released"):
        projection_for(slot.original, None)


def test_a_choice_is_timed_once_per_machine_and_read_back_from_the_cache(monkeypatch, timed_fastest):
    if not runnable("onednn", torch.float32, 64, 128):
        pytest.skip("oneDNN's packed matmul cannot run here")
    timings = timed_fastest("onednn")
    projection_for(nn.Linear(128, 64), None)
    monkeypatch.setattr(mechanism, "_chosen", {})  # a new process: the file in the cache is all it has
    projection = projection_for(nn.Linear(128, 64), None)
    assert len(timings.calls) == 1 and projection.kernel == "onednn"


def test_timing_runs_each_candidate_on_this_machine(timed_fastest, monkeypatch):
    """The real timing loop: every candidate that can run and passes the probe is timed, and the one chosen is among
    them; the rest are refused only for their error (x86 int8 without VNNI)."""
    monkeypatch.setattr(projections, "time_in_turns", mechanism.time_in_turns)
    monkeypatch.setattr(projections, "ROWS", 32)
    linear = nn.Linear(128, 128, dtype=torch.bfloat16)
    choice, build = projections.choose_projection(linear.weight.detach(), "int8")
    can_run = [k for k in (*float_kernels.KERNELS, *quant_kernels.KERNELS["int8"])
               if k not in choice.unavailable and k != "dequantize"]
    assert set(choice.seconds) == set(can_run) - choice.refused.keys() and choice.winner in choice.seconds
    assert all("above its bound" in why for why in choice.refused.values())
    assert isinstance(build(), QuantLinear if choice.winner in quant_kernels.KERNELS["int8"] else PackedLinear)


def test_the_head_runs_on_contiguous_rows_while_attached_and_computes_the_same_logits(tiny, timed_fastest):
    timed_fastest("torch")  # where torch is fastest for the head, it stays torch's Linear, on contiguous rows
    model = load_model(tiny("qwen3_moe"), dtype="bfloat16").model
    head = model.get_output_embeddings()
    hidden = torch.randn(1, 13, model.config.hidden_size).to(torch.bfloat16)
    last = hidden[:, -1:, :]  # what decoding hands the head: a slice with the stride of the whole chunk
    with torch.inference_mode():
        want = F.linear(last.contiguous(), head.weight)
        runtime = MoeRuntime(model, get_backend("cpu"))
        rows = model.get_output_embeddings()
        got = model.lm_head(last)
        generated = model.generate(input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
        runtime.detach()
    assert isinstance(rows, projections.HeadRows) and rows.original is head and rows.weight is head.weight
    assert rows.calls == 3  # the direct call and one per generated token
    assert generated.shape == (1, 5)
    assert got.shape == (1, 1, head.out_features) and torch.equal(got, want)
    assert model.get_output_embeddings() is head  # detach puts the Linear back


def _int8_kernel_here() -> str | None:
    """A quantized int8 kernel that runs bf16 activations here (not the dequantizing one)."""
    quantized = quantize(torch.randn(64, 64).to(torch.bfloat16), INT8)
    cannot = quant_kernels.unavailable_kernels(INT8, torch.bfloat16, quantized)
    return next((k for k in quant_kernels.KERNELS[INT8] if k not in cannot and k != "dequantize"), None)


def test_the_lm_head_takes_the_kernel_chosen_on_one_row_in_the_runs_format(tiny, timed_fastest, monkeypatch):
    kernel = _int8_kernel_here()
    if kernel is None:
        pytest.skip("no int8 kernel runs bf16 activations here")
    timed_fastest(kernel)
    asked = []
    choose = projections.choose_projection
    monkeypatch.setattr(projections, "choose_projection",
                        lambda weight, format, rows=projections.ROWS: asked.append((weight.shape[0], format, rows))
                        or choose(weight, format, rows))
    model = load_model(tiny("qwen3_moe"), dtype="bfloat16").model
    head = model.get_output_embeddings()
    vocabulary = head.out_features
    last = torch.randn(1, 13, model.config.hidden_size).to(torch.bfloat16)[:, -1:, :]  # a chunk's last position
    head_calls = []
    with torch.inference_mode():
        runtime = MoeRuntime(model, get_backend("cpu"), quantized=INT8)
        taken = model.get_output_embeddings()
        multiply = projections.multiply  # counted from here: the choice's own timing and probe are not calls
        monkeypatch.setattr(projections, "multiply", lambda k, linear, x, n: (n == vocabulary and head_calls.append(k))
                            or multiply(k, linear, x, n))
        got = model.lm_head(last)
        generated = model.generate(input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
        runtime.detach()
    assert (vocabulary, INT8, projections.HEAD_ROWS) in asked  # timed on a decode step's one row
    assert isinstance(taken, ProjectionLinear) and taken.original is head and taken.weight is head.weight
    assert (taken.kernel, taken.format) == (kernel, INT8)
    assert head_calls == [kernel] * 3 and generated.shape == (1, 5)  # the direct call and one per generated token
    want = last[0].double() @ quantize(head.weight, INT8).dequantize().double().T
    assert relative_error(got[0], want) <= quant_kernels.bound(kernel, torch.bfloat16)
    assert model.get_output_embeddings() is head  # detach puts the Linear back


def test_a_head_tied_to_the_embedding_keeps_its_weight_when_the_others_are_released(tiny, timed_fastest):
    kernel = _int8_kernel_here()
    if kernel is None:
        pytest.skip("no int8 kernel runs bf16 activations here")
    timed_fastest(kernel)
    model = load_model(tiny("qwen3_moe"), dtype="bfloat16").model
    model.lm_head.weight = model.get_input_embeddings().weight  # tied, as small models' heads are
    embedding = model.get_input_embeddings().weight.clone()
    MoeRuntime(model, get_backend("cpu"), quantized=INT8, release=True)
    assert isinstance(model.get_output_embeddings(), ProjectionLinear)
    assert torch.equal(model.get_input_embeddings().weight, embedding)
