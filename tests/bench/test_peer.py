"""llama.cpp beside the engine in `bench prefill`: the bench's model exported to GGUF with the same weights, the
tools' command lines carrying the run's lengths, chunk and threads, and llama-bench's JSON read into rows.

The default tests run fake tools (small scripts that record their argv and print what llama.cpp's would); the real
binaries' test is `slow` and needs them built (bench/peer/build-llama-cpp.sh).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from npumoe.bench.cli import bench
from npumoe.bench.peer.llama_cpp import LLAMA_CPP_ENV, find_llama_cpp
from npumoe.bench.peer.prefill_peer import NOTE, UNREPACKED, peer_lines, peer_rows
from npumoe.bench.prefill_bench import build_model
from npumoe.engine.moe.model_experts import moe_experts
from npumoe.engine.synthetic.geometry import parse_geometry
from npumoe.engine.synthetic.gguf_writer import write_model_gguf

TINY = parse_geometry("64x8x2x32")
CASE = {"document_tokens": 96, "chunk_tokens": 32, "threads": 3}
SAMPLES_NS = [2_000_000, 1_000_000, 4_000_000]  # median 2 ms: 96 tokens in 2 ms = 48,000 tokens/s

# llama-bench's shape: one JSON object per test, with its own mean and each repetition's nanoseconds. CRASH_BUT
# makes it die of SIGSEGV unless that argument is given, as llama.cpp's AMX path does on Sapphire Rapids.
FAKE_BENCH = f"""
import json, os, signal, sys
args = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps(["llama-bench", *args]) + "\\n")
if "--version" in args:
    print("version: 0.0.0-fake (build 7, commit abc1234)"); sys.exit(0)
crash_but = os.environ.get("CRASH_BUT")
if crash_but and crash_but not in " ".join(args):
    os.kill(os.getpid(), signal.SIGSEGV)
value = dict(zip(args, args[1:]))
print(json.dumps([{{"build_commit": "abc1234", "n_prompt": int(value["-p"]), "n_gen": int(value["-n"]),
                   "n_batch": int(value["-b"]), "n_ubatch": int(value["-ub"]), "n_threads": int(value["-t"]),
                   "avg_ts": 1.0, "stddev_ts": 0.1, "samples_ns": {SAMPLES_NS}}}]))
"""
FAKE_QUANTIZE = """
import json, os, shutil, sys
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps(["llama-quantize", *sys.argv[1:]]) + "\\n")
shutil.copyfile(sys.argv[1], sys.argv[2])
"""


@pytest.fixture
def fake_llama_cpp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A build folder as build-llama-cpp.sh leaves one (bin/ and VERSION), with fake tools logging to FAKE_LOG."""
    folder = tmp_path / "llama.cpp"
    (folder / "bin").mkdir(parents=True)
    for name, body in (("llama-bench", FAKE_BENCH), ("llama-quantize", FAKE_QUANTIZE)):
        tool = folder / "bin" / name
        tool.write_text(f"#!{sys.executable}\n{body}")
        tool.chmod(0o755)
    (folder / "VERSION").write_text("llama-cpp-python 9.9.9, built today\n")
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "calls.jsonl"))
    return folder


def calls(folder: Path) -> list[list[str]]:
    log = Path(os.environ["FAKE_LOG"])
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def engine_rows() -> list[dict]:
    """A case's rows as measure_impls leaves them: transformers' and the engine's exact CPU path, timed."""
    return [{"impl": "transformers-eager", "status": "ok", "tokens_per_s": 24_000.0, "round_seconds": [0.004]},
            {"impl": "npumoe-cpu", "status": "ok", "tokens_per_s": 96_000.0, "round_seconds": [0.001, 0.002]}]


@pytest.fixture(scope="module")
def tiny_model() -> torch.nn.Module:
    return build_model(TINY, 1, torch.bfloat16, context=128, seed=0)


def test_the_tools_are_found_in_the_build_folder_or_its_bin_with_the_version_it_recorded(fake_llama_cpp):
    for folder in (fake_llama_cpp, fake_llama_cpp / "bin"):
        tool = find_llama_cpp(folder)
        assert tool.bench == fake_llama_cpp / "bin" / "llama-bench"
        assert tool.version == "llama-cpp-python 9.9.9, built today"
    described = find_llama_cpp(fake_llama_cpp).describe()
    assert described["llama_bench_version"] == "version: 0.0.0-fake (build 7, commit abc1234)"
    assert calls(fake_llama_cpp) == [["llama-bench", "--version"]]  # it asked the binary itself


def test_a_folder_without_the_tools_is_refused_naming_the_build_script(tmp_path):
    with pytest.raises(ValueError, match=r"build-llama-cpp\.sh"):
        find_llama_cpp(tmp_path)


def test_the_command_line_refuses_a_peer_folder_without_the_tools(tmp_path, monkeypatch):
    monkeypatch.delenv(LLAMA_CPP_ENV, raising=False)
    result = CliRunner().invoke(bench, ["prefill", "--geometry", "64x8x2x32", "--dtype", "bf16", "--peer",
                                        str(tmp_path)])
    assert result.exit_code == 2 and "no llama-bench and llama-quantize" in result.output


def test_the_peer_runs_the_cases_lengths_chunk_and_threads_on_each_format(fake_llama_cpp, tiny_model):
    tool = find_llama_cpp(fake_llama_cpp)
    rows = peer_rows(tool, tiny_model, CASE, engine_rows(), warmup=1, repeats=3)
    peer = {row["impl"]: row for row in rows if row["impl"].startswith("llama.cpp-")}
    assert list(peer) == ["llama.cpp-bf16", "llama.cpp-q8_0", "llama.cpp-q4_0"]
    made = calls(fake_llama_cpp)
    quantized = [call for call in made if call[0] == "llama-quantize"]
    assert [(Path(c[1]).name, Path(c[2]).name, c[3], c[4]) for c in quantized] == [
        ("model-bf16.gguf", "model-q8_0.gguf", "Q8_0", "3"), ("model-bf16.gguf", "model-q4_0.gguf", "Q4_0", "3")]
    benched = [call for call in made if call[0] == "llama-bench"]
    assert [Path(call[call.index("-m") + 1]).name for call in benched] == [
        "model-bf16.gguf", "model-q8_0.gguf", "model-q4_0.gguf"]
    for call in benched:
        value = dict(itertools.pairwise(call[1:]))
        assert (value["-p"], value["-n"], value["-b"], value["-ub"], value["-t"], value["-r"], value["-o"]) == (
            "96", "0", "96", "32", "3", "3", "json")
        assert "--no-warmup" not in call
    bf16 = peer["llama.cpp-bf16"]
    assert bf16["status"] == "unchecked" and bf16["note"] == NOTE
    assert bf16["seconds"] == 0.002 and bf16["tokens_per_s"] == pytest.approx(48_000)  # the samples' median
    assert bf16["sample_seconds"] == [0.002, 0.001, 0.004] and bf16["llama_bench"]["n_ubatch"] == 32
    assert bf16["vs_transformers_best"] == pytest.approx(2.0) and bf16["vs_engine_best"] == pytest.approx(0.5)
    assert bf16["vs_engine_best_range"] == pytest.approx([250 / 1000, 1000 / 500])  # slowest vs fastest, both ways
    assert bf16["gguf_types"] == {"BF16": 10, "F32": 5}  # the file written, read back
    assert [row["impl"] for row in rows[:2]] == ["transformers-eager", "npumoe-cpu"]  # the case's rows kept
    assert len(peer_lines(rows)) == 3


def test_no_warmup_asked_turns_llama_benchs_own_warmup_off(fake_llama_cpp, tiny_model):
    peer_rows(find_llama_cpp(fake_llama_cpp), tiny_model, CASE, engine_rows(), warmup=0, repeats=1)
    assert all("--no-warmup" in call for call in calls(fake_llama_cpp) if call[0] == "llama-bench")


def test_a_crash_with_repacked_weights_is_run_again_without_and_says_so(fake_llama_cpp, tiny_model,
                                                                       monkeypatch):
    monkeypatch.setenv("CRASH_BUT", "--repack 0")
    rows = peer_rows(find_llama_cpp(fake_llama_cpp), tiny_model, CASE, engine_rows(), warmup=1, repeats=3)
    peer = [row for row in rows if row["impl"].startswith("llama.cpp-")]
    assert all(row["fallback"] == UNREPACKED and row["llama_bench_args"][-2:] == ["--repack", "0"]
               and "signal 11" in row["crash"] and row["tokens_per_s"] > 0 for row in peer)
    assert len([call for call in calls(fake_llama_cpp) if call[0] == "llama-bench"]) == 6  # each tried twice


def test_a_peer_that_prints_no_json_is_reported_not_timed(fake_llama_cpp, tiny_model):
    (fake_llama_cpp / "bin" / "llama-bench").write_text(f"#!{sys.executable}\nprint('oops')\n")
    rows = peer_rows(find_llama_cpp(fake_llama_cpp), tiny_model, CASE, engine_rows(), warmup=1, repeats=3)
    peer = [row for row in rows if row["impl"].startswith("llama.cpp-")]
    assert all(row["status"] == "skipped" and "no JSON" in row["error"] and "tokens_per_s" not in row
               for row in peer)


def test_the_gguf_holds_the_models_own_weights_and_llama_cpps_none_vocabulary(tiny_model, tmp_path):
    file = write_model_gguf(tiny_model, None, tmp_path / "m.gguf", experts=gguf.GGMLQuantizationType.BF16,
                            weights=gguf.GGMLQuantizationType.BF16)
    reader = gguf.GGUFReader(file)
    assert reader.fields["tokenizer.ggml.model"].contents() == "none"
    assert reader.fields["qwen3moe.vocab_size"].contents() == tiny_model.config.vocab_size
    experts = moe_experts(tiny_model)[0][1]
    gate, up = experts.gate_up_proj.float().chunk(2, dim=1)
    expected = {"token_embd.weight": tiny_model.model.embed_tokens.weight, "blk.0.ffn_gate_exps.weight": gate,
                "blk.0.ffn_up_exps.weight": up, "blk.0.ffn_down_exps.weight": experts.down_proj,
                "output.weight": tiny_model.lm_head.weight}
    stored = {t.name: torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type))).reshape(
        tuple(reversed([int(d) for d in t.shape]))) for t in reader.tensors if t.name in expected}
    for name, weight in expected.items():
        assert torch.equal(stored[name], weight.float()), name  # bf16 in, bf16 stored: bit for bit


def _built_llama_cpp() -> Path | None:
    folder = Path(os.environ.get(LLAMA_CPP_ENV, Path.home() / ".cache" / "npumoe" / "llama.cpp"))
    try:
        find_llama_cpp(folder)
    except ValueError:
        return None
    return folder


@pytest.mark.slow
@pytest.mark.skipif(_built_llama_cpp() is None,
                    reason=f"no llama.cpp build: run bench/peer/build-llama-cpp.sh, or set {LLAMA_CPP_ENV}")
def test_the_real_llama_bench_prefills_the_exported_model_in_every_format():
    model = build_model(parse_geometry("256x8x2x128"), 1, torch.bfloat16, context=64, seed=0)
    case = {"document_tokens": 64, "chunk_tokens": 32, "threads": 2}
    rows = peer_rows(find_llama_cpp(_built_llama_cpp()), model, case, engine_rows(), warmup=1, repeats=2)
    peer = {row["impl"]: row for row in rows if row["impl"].startswith("llama.cpp-")}
    assert list(peer) == ["llama.cpp-bf16", "llama.cpp-q8_0", "llama.cpp-q4_0"]
    for row in peer.values():
        assert row["status"] == "unchecked", row.get("error")
        assert row["llama_bench"]["n_prompt"] == 64 and row["llama_bench"]["n_ubatch"] == 32
        assert row["tokens_per_s"] > 0 and len(row["sample_seconds"]) == 2
    assert peer["llama.cpp-q4_0"]["gguf_types"].get("Q4_0", 0) > 0


def test_bench_prefill_puts_the_peers_rows_in_its_table_and_json(fake_llama_cpp, tmp_path, monkeypatch):
    monkeypatch.setenv(LLAMA_CPP_ENV, str(fake_llama_cpp))  # the option's default
    out = tmp_path / "prefill.json"
    result = CliRunner().invoke(bench, ["prefill", "--geometry", "64x8x2x32", "--layers", "1", "--document-tokens",
                                        "64", "--chunk", "32", "--dtype", "fp32", "--threads", "1", "--warmup", "0",
                                        "--repeats", "1", "--calibration-documents", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "llama.cpp-q4_0" in result.output and "the engine's best exact path" in result.output
    written = json.loads(out.read_text())
    assert written["settings"]["peer"]["version"] == "llama-cpp-python 9.9.9, built today"
    peer = [row for row in written["results"] if row["impl"].startswith("llama.cpp-")]
    assert [row["impl"] for row in peer] == ["llama.cpp-f32", "llama.cpp-q8_0", "llama.cpp-q4_0"]
    assert all(row["document_tokens"] == 64 and row["chunk_tokens"] == 32 and "vs_engine_best" in row for row in peer)
    benched = [call for call in calls(fake_llama_cpp) if call[0] == "llama-bench" and "-m" in call]
    assert [call[call.index("-ub") + 1] for call in benched] == ["32"] * 3
