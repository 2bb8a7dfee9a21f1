"""`bench fidelity --peer`: llama-perplexity's figures read from what it prints, the tokens it evaluated read back
from its logits file, and the engine's perplexity computed on those tokens in llama-perplexity's chunks.

A fake llama-perplexity (a small script that records its argv, writes the head of the logits file and prints the
real tool's lines) stands in for the binary."""

from __future__ import annotations

import json
import math
import stat
import struct
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from npumoe.bench import machine
from npumoe.bench.cli import bench
from npumoe.bench.fidelity.peer import chunked_perplexity
from npumoe.bench.peer.llama_cpp import parse_perplexity, read_evaluated_tokens
from npumoe.engine import api as engine_module

# The end of a real llama-perplexity run (llama.cpp in llama-cpp-python 0.3.36, --chunks 2), its system line cut.
CAPTURED = """\
0.00.381.466 I cmn          init: llama threadpool init, n_threads = 2
0.00.458.368 I system_info: n_threads = 2 (n_threads_batch = 2) / 2 | CPU : SSE3 = 1 | ...
0.00.458.381 I perplexity: tokenizing the input ..
0.00.520.990 I perplexity: tokenization took 62.598 ms
0.00.526.314 I perplexity: calculating perplexity over 2 chunks, n_ctx=512, batch_size=2048, n_seq=4
0.17.970.353 I perplexity: 17.44 seconds per pass - ETA 0.13 minutes
[1]59.7647,[2]40.2797,
0.18.126.363 I Final estimate: PPL = 40.2797 +/- 5.77792
"""

CONTEXT, CHUNKS, VOCAB = 16, 3, 256


def test_llama_perplexitys_final_estimate_chunks_and_load_time_are_read():
    run = parse_perplexity(CAPTURED)
    assert (run.perplexity, run.error, run.chunks, run.context, run.load_s) == (40.2797, 5.77792, 2, 512, 0.458381)


def test_output_without_a_final_estimate_is_an_error_quoting_it():
    with pytest.raises(RuntimeError, match=r"no final estimate.*too few tokens"):
        parse_perplexity("perplexity: you need at least 1024 tokens to evaluate perplexity: too few tokens")


def test_the_engines_figure_scores_the_second_half_of_each_whole_chunk_with_bos_first():
    seen: list[list[int]] = []

    def uniform(chunk: list[int]) -> torch.Tensor:
        seen.append(chunk)
        return torch.zeros(len(chunk), 50)

    tokens = list(range(10, 10 + 2 * CONTEXT + 5))  # two whole chunks and a rest llama-perplexity drops too
    perplexity, scored = chunked_perplexity(uniform, tokens, CONTEXT, bos=1)
    assert scored == 2 * (CONTEXT - 1 - CONTEXT // 2) and math.isclose(perplexity, 50)
    assert [chunk[0] for chunk in seen] == [1, 1] and seen[1][1:] == tokens[CONTEXT + 1:2 * CONTEXT]


def _fake_perplexity(folder: Path) -> None:
    """llama-bench, llama-quantize (not run) and a llama-perplexity that saves CHUNKS chunks of tokens as the real
    one does at the head of its --kl-divergence-base file and prints its lines."""
    for name in ("llama-bench", "llama-quantize"):
        (folder / name).write_text("#!/bin/sh\n")
    body = f"""#!{sys.executable}
import json, struct, sys
args = sys.argv[1:]
open({str(folder / 'calls.jsonl')!r}, "a").write(json.dumps(args) + "\\n")
context = int(args[args.index("-c") + 1])
tokens = [(7 * i) % 200 + 3 for i in range({CHUNKS} * context)]
with open(args[args.index("--kl-divergence-base") + 1], "wb") as f:
    f.write(b"_logits_" + struct.pack("<iii", context, {VOCAB}, {CHUNKS}))
    f.write(struct.pack(f"<{{len(tokens)}}i", *tokens))
print({CAPTURED!r}.replace("2 chunks, n_ctx=512", f"{CHUNKS} chunks, n_ctx={{context}}"), file=sys.stderr)
"""
    (folder / "llama-perplexity").write_text(body)
    for tool in folder.iterdir():
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)


def test_the_engine_runs_on_the_tokens_llama_perplexity_evaluated(tiny_gguf, tmp_path, monkeypatch):
    folder = tmp_path / "llama.cpp"
    folder.mkdir()
    _fake_perplexity(folder)
    chunks: list[list[int]] = []
    logits = engine_module.Engine.logits

    def spied(self, ids):
        chunks.append(list(ids))
        return logits(self, ids)

    monkeypatch.setattr(engine_module.Engine, "logits", spied)
    monkeypatch.setattr(machine, "describe_machine", lambda threads: {"cpu": "a test CPU", "threads": threads})
    model, out = tiny_gguf("qwen3_moe", "Q4_0"), tmp_path / "peer.json"
    result = CliRunner().invoke(bench, ["fidelity", "--model", str(model), "--peer", str(folder), "--context",
                                        str(CONTEXT), "--chunk", "8", "--threads", "2", "--json", str(out)])
    assert result.exit_code == 0, result.output
    call = json.loads((folder / "calls.jsonl").read_text())
    assert call[call.index("-m") + 1] == str(model) and call[call.index("-t") + 1] == "2"
    tokens = [(7 * i) % 200 + 3 for i in range(CHUNKS * CONTEXT)]
    assert chunks == [tokens[i:i + CONTEXT] for i in range(0, len(tokens), CONTEXT)]  # no BOS asked by the file
    row = json.loads(out.read_text())["results"][0]
    assert (row["weights"], row["chunks"], row["scored_tokens"]) == ("int4", CHUNKS, CHUNKS * (CONTEXT // 2 - 1))
    assert row["llama_cpp_perplexity"] == 40.2797 and row["ratio"] == row["engine_perplexity"] / 40.2797
    assert row["llama_cpp_load_s"] == 0.458381 and "mapped from their blocks" in row["engine_conversions"]
    assert row["engine_load_s"] > 0 and row["engine_peak_rss"] >= row["engine_rss_before_load"] > 0


def test_a_logits_file_announcing_more_tokens_than_it_holds_is_refused(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"_logits_" + struct.pack("<iiii", 4, VOCAB, 2, 5))
    with pytest.raises(ValueError, match="8 tokens announced, 1 there"):
        read_evaluated_tokens(path)
