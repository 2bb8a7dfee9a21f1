"""`bench decode`: every format's engine decodes in interleaved rounds, the head's A/B swaps the head for the
round and back, and the profile charges a decode step to the model's parts."""

from __future__ import annotations

from npumoe.bench.decode import ENGINE_HEAD, TORCH_HEAD, DecodeSettings, run_decode_bench
from npumoe.engine.attach import projections


def test_each_format_decodes_in_interleaved_rounds_with_the_heads_ab_and_a_profile(tiny_model, monkeypatch):
    heads = []
    forward = projections.HeadRows.forward
    monkeypatch.setattr(projections.HeadRows, "forward", lambda self, x: heads.append(1) or forward(self, x))
    settings = DecodeSettings(depth=8, tokens=3, rounds=2, threads=1, head_torch=True, profile=True)
    rows = run_decode_bench(str(tiny_model), ["fp32", "bf16"], settings)
    assert [(row["weights"], row["head"]) for row in rows] == [("fp32", ENGINE_HEAD), ("bf16", ENGINE_HEAD),
                                                              ("fp32", TORCH_HEAD), ("bf16", TORCH_HEAD)]
    assert all(row["tok_s_min"] <= row["tok_s"] <= row["tok_s_max"] and row["rounds"] == 2 for row in rows)
    assert all(row["tokens"] >= 1 for row in rows)
    assert heads  # the torch-head rounds ran through HeadRows
    profiled = [row["ms_per_step"] for row in rows if "ms_per_step" in row]
    assert len(profiled) == 2 and all(parts["head"] > 0 and parts["experts"] > 0 for parts in profiled)
