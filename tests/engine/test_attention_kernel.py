"""The engine's own attention kernel equals eager attention (float32 to 1e-5; bf16 as close as torch's own bf16
attention), alone and inside chunked prefill where it is what ran; masks it cannot express stay with torch; and
the choice between it and torch's kernel is measured once and cached."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from npumoe.engine.attach import attention
from npumoe.engine.attach.attention import key_ranges, use_engine_attention
from npumoe.engine.generate.prefill import new_cache, prefill
from npumoe.engine.kernels import attention_choice, attention_kernel
from npumoe.engine.kernels import choice as mechanism
from npumoe.engine.kernels.choice import Choice

_WHY = attention_kernel.unavailable(torch.float32)
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"the attention kernel cannot run here: {_WHY}")


def _eager(query, key, value, lo, hi, sinks=None):
    """Float64 attention of each query position over keys lo..hi-1, with an optional sink logit per head."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.double().repeat_interleave(groups, 1), value.double().repeat_interleave(groups, 1)
    scores = query.double() @ key.transpose(-1, -2) * query.shape[-1] ** -0.5
    columns = torch.arange(key.shape[2])
    scores = scores.masked_fill(~((columns >= lo[:, None]) & (columns < hi[:, None])), float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.double().reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
    weights = scores.softmax(-1)[..., :key.shape[2]]
    return (weights @ value).transpose(1, 2)


CASES = {  # batch, query heads, KV heads, rows, cached keys before the chunk, window, sinks, head size
    "causal chunk at depth, grouped heads": (1, 8, 2, 45, 200, None, False, 64),
    "first chunk, one head per KV head": (1, 4, 4, 33, 0, None, False, 128),
    "sliding window with sinks": (1, 8, 2, 37, 90, 16, True, 64),
    "one row (decode), two documents": (2, 16, 2, 1, 70, None, True, 128),
}


def _case(name, dtype):
    batch, heads, kv_heads, rows, past, window, sinks, dim = CASES[name]
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(batch, heads, rows, dim, generator=generator).to(dtype)
    key = torch.randn(batch, kv_heads, past + rows, dim, generator=generator).to(dtype)
    value = torch.randn(batch, kv_heads, past + rows, dim, generator=generator).to(dtype)
    hi = torch.arange(past + 1, past + rows + 1)
    lo = (hi - window).clamp(min=0) if window else torch.zeros_like(hi)
    return query, key, value, lo, hi, torch.randn(heads, generator=generator) if sinks else None


def _relative(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_kernel_equals_eager_attention_in_float32(name):
    query, key, value, lo, hi, sinks = _case(name, torch.float32)
    out = attention_kernel.attend(query, key, value, lo, hi, scale=query.shape[-1] ** -0.5, sinks=sinks)
    assert _relative(out, _eager(query, key, value, lo, hi, sinks)) < 1e-5


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_avx2_body_equals_eager_attention_in_float32_where_avx512_is_not_allowed(name, monkeypatch):
    """What an AVX2-only x86 (AMD Zen 3, an Intel Mac) runs; here under the engine's instruction set ceiling."""
    widest = attention_kernel.body(torch.float32)
    query, key, value, lo, hi, sinks = _case(name, torch.float32)
    scale = query.shape[-1] ** -0.5
    wide = attention_kernel.attend(query, key, value, lo, hi, scale=scale, sinks=sinks)
    monkeypatch.setenv("NPUMOE_MAX_CPU_ISA", "avx2")
    assert attention_kernel.body(torch.float32) == "avx2"
    library, calls = attention_kernel.KERNEL.library(), []
    avx2 = library.npumoe_attention_f32_avx2
    monkeypatch.setattr(library, "npumoe_attention_f32_avx2", lambda *a: calls.append(1) or avx2(*a))
    out = attention_kernel.attend(query, key, value, lo, hi, scale=scale, sinks=sinks)
    assert len(calls) == query.shape[0]  # one call per document
    assert _relative(out, _eager(query, key, value, lo, hi, sinks)) < 1e-5
    if widest == "avx512":  # the two bodies differ only in float rounding
        assert _relative(out, wide) < 1e-6


@pytest.mark.skipif(attention_kernel.unavailable(torch.bfloat16) is not None, reason="no bf16 attention kernel here")
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_kernel_in_bf16_is_as_close_to_exact_as_torchs_bf16_attention(name):
    query, key, value, lo, hi, sinks = _case(name, torch.bfloat16)
    exact = _eager(query, key, value, lo, hi, sinks)
    out = attention_kernel.attend(query, key, value, lo, hi, scale=query.shape[-1] ** -0.5, sinks=sinks)
    columns = torch.arange(key.shape[2])
    mask = ((columns >= lo[:, None]) & (columns < hi[:, None]))[None, None]
    if sinks is None:
        theirs = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True).transpose(1, 2)
    else:
        theirs = attention._with_sinks(query, key, value, mask, sinks, scaling=None, causal=False).transpose(1, 2)
    assert _relative(out, exact) < 1.5 * _relative(theirs, exact) + 1e-3


def test_masks_that_are_one_run_of_keys_per_row_become_ranges_and_others_stay_with_torch(monkeypatch):
    lo, hi = torch.tensor([0, 2, 3, 3]), torch.tensor([5, 6, 7, 8])
    columns = torch.arange(8)
    visible = ((columns >= lo[:, None]) & (columns < hi[:, None]))[None, None]
    assert all(torch.equal(a, b) for a, b in zip(key_ranges(visible, 4, 8, causal=False), (lo, hi), strict=True))
    additive = torch.zeros(visible.shape).masked_fill_(~visible, torch.finfo(torch.float32).min)
    assert torch.equal(key_ranges(additive, 4, 8, causal=False)[1], hi)
    assert key_ranges(additive + 0.5 * visible, 4, 8, causal=False) is None  # a bias on the seen keys
    holes = visible.clone()
    holes[0, 0, 1, 4] = False
    assert key_ranges(holes, 4, 8, causal=False) is None
    assert key_ranges(visible.expand(1, 2, 4, 8), 4, 8, causal=False) is None  # one mask per head
    blind = visible.clone()
    blind[0, 0, 2] = False  # a row that sees nothing
    assert [r.tolist() for r in key_ranges(blind, 4, 8, causal=False)] == [[0, 2, 0, 3], [5, 6, 0, 8]]
    lo, hi = key_ranges(None, 3, 10, causal=True)
    assert lo.tolist() == [0, 0, 0] and hi.tolist() == [1, 2, 3]
    calls = []
    monkeypatch.setattr(attention, "_mask_ranges", lambda *a: calls.append(a) or (lo, hi))
    shared = visible.clone()
    key_ranges(shared, 4, 8, causal=False)
    key_ranges(shared, 4, 8, causal=False)  # the next layer of the same chunk
    assert len(calls) == 1
    shared[0, 0, 0, 0] = False  # edited in place: read again
    key_ranges(shared, 4, 8, causal=False)
    assert len(calls) == 2


SMALL = {"hidden_size": 128, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 97, "max_position_embeddings": 256}
FAMILIES = {
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"]},
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@torch.inference_mode()
def test_chunked_prefill_through_the_kernel_equals_eager_on_the_whole_document(family, monkeypatch):
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **SMALL, **FAMILIES[family])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    for module in model.modules():
        if hasattr(module, "sinks"):
            module.sinks.data.normal_()
    ids = torch.randint(SMALL["vocab_size"], (40,), generator=torch.Generator().manual_seed(1)).tolist()
    model.set_attn_implementation("eager")
    reference = model.base_model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    monkeypatch.setattr(attention_choice, "choose", lambda *a: Choice("npumoe", {}, {}))
    calls = []
    attend = attention_kernel.attend
    monkeypatch.setattr(attention_kernel, "attend", lambda *a, **k: calls.append(1) or attend(*a, **k))
    use_engine_attention(model)
    chunked = torch.cat(list(prefill(model, ids, 12, new_cache(model))))
    assert _relative(chunked, reference) < 1e-5
    assert len(calls) == 4 * SMALL["num_hidden_layers"]  # every layer of every chunk


def test_the_choice_is_timed_once_per_machine_and_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("NPUMOE_CACHE", str(tmp_path))
    monkeypatch.setattr(mechanism, "_chosen", {})
    timed = []
    time_kernels = attention_choice.time_kernels
    monkeypatch.setattr(attention_choice, "time_kernels", lambda *a: timed.append(a) or time_kernels(*a))
    query, key, value, *_ = _case("causal chunk at depth, grouped heads", torch.float32)
    first = attention_choice.choose(query, key, value)
    assert timed == [(["npumoe", "torch"], torch.float32, 8, 2, 64)] and first.seconds.keys() == {"npumoe", "torch"}
    assert first.refused == {}  # both passed the probe
    assert first.winner == min(first.seconds, key=first.seconds.__getitem__)
    monkeypatch.setattr(mechanism, "_chosen", {})  # a new process: read from the machine's cache
    assert attention_choice.choose(query, key, value) == first and len(timed) == 1
    shape = {"heads": 8, "kv_heads": 2, "head_dim": 64, "body": attention_kernel.body(torch.float32)}
    key = mechanism.Measured.key(torch.float32, shape, torch.get_num_threads())
    assert attention_choice.CHOICES.cached()[key] == first


def test_a_decode_step_is_timed_on_one_row_and_kept_apart_from_the_chunk(monkeypatch, tmp_path):
    monkeypatch.setenv("NPUMOE_CACHE", str(tmp_path))
    monkeypatch.setattr(mechanism, "_chosen", {})
    monkeypatch.setattr(attention_choice, "_made", {})
    timed = []
    time_kernels = attention_choice.time_kernels
    monkeypatch.setattr(attention_choice, "time_kernels", lambda *a, **k: timed.append(k) or time_kernels(*a, **k))
    query, key, value, *_ = _case("causal chunk at depth, grouped heads", torch.float32)
    chunk = attention_choice.choose(query, key, value)
    step = attention_choice.choose(query[:, :, -1:], key, value)
    assert timed == [{}, {"chunk": attention_choice.DECODE_ROWS}]  # each regime timed once, at its own rows
    assert step.winner == min(step.seconds, key=step.seconds.__getitem__) and step.refused == {}
    assert attention_choice.choose(query[:, :, :1], key, value) is step and chunk is not step


def test_a_choice_timed_on_one_thread_count_is_not_reused_at_another(monkeypatch, tmp_path):
    monkeypatch.setenv("NPUMOE_CACHE", str(tmp_path))
    monkeypatch.setattr(mechanism, "_chosen", {})
    timed = []
    monkeypatch.setattr(attention_choice, "time_kernels",
                        lambda *a: timed.append(torch.get_num_threads()) or {"npumoe": 1e-3, "torch": 2e-3})
    query, key, value, *_ = _case("causal chunk at depth, grouped heads", torch.float32)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 1, 2):
            torch.set_num_threads(count)
            attention_choice.choose(query, key, value)
    finally:
        torch.set_num_threads(threads)
    assert timed == [1, 2]  # each count timed once, on that many threads, then read back
    assert {key.rpartition(" threads ")[2] for key in attention_choice.CHOICES.cached()} == {"1", "2"}


def test_shapes_the_kernel_cannot_take_stay_with_torch_and_say_why():
    query = torch.randn(1, 4, 5, 16)
    choice = attention_choice.choose(query, torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16))
    assert choice.winner == "torch" and "multiple of 64" in choice.unavailable["npumoe"]
    with pytest.raises(ValueError, match="cannot take"):
        attention_kernel.attend(query, torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16), torch.zeros(5),
                                torch.full((5,), 9), scale=0.25)


@torch.inference_mode()
def test_each_layout_looks_its_choice_up_once_not_once_per_layer_and_decode_step(monkeypatch, tmp_path):
    """The measured-choice mechanism is asked once per dtype and head layout (and cache), not on every layer's call:
    the look-up was ~8 % of a small model's decode step."""
    monkeypatch.setenv("NPUMOE_CACHE", str(tmp_path / "first"))
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_moe", **{**SMALL, "num_hidden_layers": 3}, **FAMILIES["qwen3_moe"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    use_engine_attention(model)
    looked_up, attended = [], []
    choose = attention_choice.CHOICES.choose
    monkeypatch.setattr(attention_choice.CHOICES, "choose", lambda *a, **k: looked_up.append(a) or choose(*a, **k))
    engine_attention = attention.engine_attention
    monkeypatch.setattr(attention, "engine_attention", lambda *a, **k: attended.append(1) or engine_attention(*a, **k))
    for name in attention.IMPLEMENTATIONS.values():  # the registry holds the function itself: register the spy
        attention.ALL_ATTENTION_FUNCTIONS.register(name, attention.engine_attention)
    try:
        ids = torch.tensor([[1, 2, 3, 4, 5]])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                             min_new_tokens=4, pad_token_id=0)
        assert out.shape[1] == 9 and len(attended) == 3 * 4  # three layers, a prefill and three decode steps
        # the prefill's rows and the decode steps' one row: a choice each
        assert [shape.get("chunk") for _, shape, *_ in looked_up] == [None, attention_choice.DECODE_ROWS]
        monkeypatch.setenv("NPUMOE_CACHE", str(tmp_path / "second"))  # another cache holds other choices
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, pad_token_id=0)
        assert len(looked_up) == 3
    finally:
        for name in attention.IMPLEMENTATIONS.values():
            attention.ALL_ATTENTION_FUNCTIONS.register(name, engine_attention)
