"""`bench document`: a document through the daemon's path (extraction in its child, then the engine), its row's rates
taken from what the engine reported; llama.cpp beside it on the same file and threads, or a row saying why not."""

from __future__ import annotations

import json
import os
import stat
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from npumoe.bench import readme_tables
from npumoe.bench.document import run as bench_document
from npumoe.bench.document.run import DocumentBenchSettings, results_stem, run_document_bench
from npumoe.engine import api as engine_module
from npumoe.jobs.extract import isolated

TEXT = ("The lighthouse keeper writes the weather down every hour. Ships pass at night and the lamp turns. " * 6)[:600]
THREADS = 2


@pytest.fixture
def counted(monkeypatch) -> dict[str, int]:
    """Extractions and engine calls, counted as the bench makes them."""
    calls = {"extract": 0, "process": 0}
    extract, process = isolated.extract_text, engine_module.Engine.process

    def extracting(path, *args, **kwargs):
        calls["extract"] += 1
        return extract(path, *args, **kwargs)

    def processing(self, text, *args, **kwargs):
        calls["process"] += 1
        return process(self, text, *args, **kwargs)

    monkeypatch.setattr(isolated, "extract_text", extracting)
    monkeypatch.setattr(engine_module.Engine, "process", processing)
    return calls


def _settings(model: Path, tmp_path: Path, **kwargs) -> DocumentBenchSettings:
    """The engine in this process, where the spies see it, unless the test asks otherwise."""
    document = tmp_path / "keeper.txt"
    document.write_text(TEXT)
    kwargs.setdefault("engine_apart", False)
    return DocumentBenchSettings(model=str(model), documents=(document,), threads=THREADS, summary_tokens=4,
                                 section_tokens=200, **kwargs)


def test_a_document_is_extracted_and_processed_and_its_rates_come_from_the_engines_phases(tiny_gguf, tmp_path,
                                                                                         counted, monkeypatch):
    monkeypatch.delenv("NPUMOE_LLAMA_CPP", raising=False)
    engine, peer = run_document_bench(_settings(tiny_gguf("qwen3_moe"), tmp_path))
    assert counted == {"extract": 1, "process": 1}
    assert (engine["impl"], engine["status"], engine["document"]) == ("npumoe", "ran", "keeper.txt")
    assert engine["tokens"] == len(TEXT.strip()) and engine["sections"] == 3  # the byte tokenizer: a token a byte
    assert engine["decode_depth"] == round(engine["tokens"] / 3)
    assert engine["prefill_tokens_per_s"] == engine["tokens"] / engine["phase_seconds"]["prefill"]
    decoding = engine["phase_seconds"]["summary"] + engine["phase_seconds"]["reduce"]
    assert engine["generated_tokens"] > 0
    assert engine["decode_tokens_per_s"] == engine["generated_tokens"] / decoding
    assert engine["seconds"] > engine["phase_seconds"]["total"] and engine["load_s"] > 0
    assert engine["cpu_seconds"] > 0 and engine["peak_rss"] >= engine["rss_before_load"] > 0
    assert peer == {"document": "keeper.txt", "model": engine["model"], "impl": "llama.cpp", "status": "skipped",
                    "note": peer["note"]}
    assert "no llama.cpp build" in peer["note"]


def _fake_tool(folder: Path, name: str, body: str) -> None:
    """A stand-in for one llama.cpp binary: it records its arguments, then does `body` (Python)."""
    path = folder / name
    path.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"open({str(folder / 'calls.jsonl')!r}, 'a').write(json.dumps(sys.argv) + '\\n')\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def fake_llama_cpp(tmp_path) -> Path:
    """A llama.cpp build folder whose llama-bench answers every test at 100 tokens/s and whose llama-completion
    prints llama.cpp's timing lines, holding 48 MiB written while it runs."""
    folder = tmp_path / "llama.cpp"
    folder.mkdir()
    _fake_tool(folder, "llama-bench", "args = sys.argv\n"
                                      "p, n = int(args[args.index('-p') + 1]), int(args[args.index('-n') + 1])\n"
                                      "print(json.dumps([{'n_prompt': p, 'n_gen': n, 'avg_ts': 100.0, "
                                      "'samples_ns': [1]}]))")
    _fake_tool(folder, "llama-quantize", "")
    _fake_tool(folder, "llama-completion", "import time\nheld = bytearray(b'x' * (48 << 20))\ntime.sleep(0.3)\n"
                                           "print('llama_perf_context_print:        load time =     250.00 ms', "
                                           "file=sys.stderr)\n"
                                           "print('llama_perf_context_print:       total time =    1500.00 ms / 9 "
                                           "tokens', file=sys.stderr)")
    return folder


def test_llama_cpp_runs_on_the_same_file_threads_lengths_and_depth_and_does_the_documents_calls(
        tiny_gguf, tmp_path, fake_llama_cpp):
    model = tiny_gguf("qwen3_moe")
    engine, peer = run_document_bench(_settings(model, tmp_path, peer=fake_llama_cpp, repeats=1))
    calls = [json.loads(line) for line in (fake_llama_cpp / "calls.jsonl").read_text().splitlines()]
    for argv in calls:
        assert argv[argv.index("-m") + 1] == str(model) and argv[argv.index("-t") + 1] == str(THREADS)
    prefill, decode, *completions = calls
    depth, per_call = engine["decode_depth"], peer["generated_per_call"]
    assert per_call == max(1, round(engine["generated_tokens"] / engine["decode_calls"]))
    assert (prefill[prefill.index("-p") + 1], prefill[prefill.index("-n") + 1]) == (str(depth), "0")
    assert (decode[decode.index("-n") + 1], decode[decode.index("-d") + 1]) == (str(per_call), str(depth))
    assert len(completions) == peer["calls"] == engine["sections"] + 1  # each section, then the combine
    assert all(argv[argv.index("-n") + 1] == str(per_call) and "--ignore-eos" in argv for argv in completions)
    assert (peer["status"], peer["prefill_tokens_per_s"], peer["decode_tokens_per_s"]) == ("ran", 100.0, 100.0)
    assert peer["load_s"] == 0.25 and [t["total"] for t in peer["call_seconds"]] == [1.5] * len(completions)
    assert peer["generated_tokens"] == per_call * len(completions) and peer["seconds"] > 0
    # the tool's own peak: what it held, not the bench process's size that a forked child inherits
    assert 48 << 20 < peer["peak_rss"] < engine["rss_before_load"]
    assert engine["vs_llama_cpp"] == {"prefill_tokens_per_s": engine["prefill_tokens_per_s"] / 100.0,
                                      "decode_tokens_per_s": engine["decode_tokens_per_s"] / 100.0,
                                      "seconds": peer["seconds"] / engine["seconds"]}
    results = tmp_path / "bench" / "results" / "document-tiny.json"
    results.parent.mkdir(parents=True)
    results.write_text(json.dumps({"machine": {"cpu": "A CPU", "threads": THREADS}, "results": [engine, peer]}))
    marked = "<!-- documents from bench/results/document-tiny.json -->\n<!-- end rendered -->"
    lines = readme_tables.render(marked, root=tmp_path).splitlines()[3:-1]
    assert [line.split(" | ")[3] for line in lines] == ["npumoe", "llama.cpp"]
    assert f"({engine['vs_llama_cpp']['seconds']:.2f}×)" in lines[0].split(" | ")[10]


def test_llama_cpp_is_skipped_with_the_reason_when_the_model_is_not_a_gguf_file(tiny, tmp_path, fake_llama_cpp):
    _, peer = run_document_bench(_settings(tiny("qwen3_moe"), tmp_path, peer=fake_llama_cpp))
    assert peer["status"] == "skipped" and "not a GGUF file" in peer["note"]
    assert not (fake_llama_cpp / "calls.jsonl").exists()


def test_the_engine_runs_in_a_process_of_its_own_that_exits_before_llama_cpp_starts(tiny_gguf, tmp_path,
                                                                                   fake_llama_cpp):
    """A closed engine's memory stays with its process: the full-size model beside llama.cpp's ran out of memory."""
    engine, peer = run_document_bench(_settings(tiny_gguf("qwen3_moe"), tmp_path, peer=fake_llama_cpp, repeats=1,
                                                engine_apart=True))
    assert engine["status"] == "ran" and engine["engine_pid"] != os.getpid()
    assert engine["generated_tokens"] > 0 and peer["status"] == "ran"


def test_results_are_named_for_the_model_the_cpu_and_its_cores():
    machine = {"cpu": "Intel(R) Xeon(R) Platinum 8480+ CPU @ 2.00GHz", "logical_cores": 2}
    when = datetime(2026, 12, 4, tzinfo=UTC)
    assert results_stem(machine, "/cache/qwen3-30b-a3b-random-q4_0.gguf", when) == \
        "document-qwen3-30b-a3b-random-q4-0-intel-xeon-platinum-8480-2core-2026-12-04"
    assert results_stem(machine, "demo", when).startswith("document-demo-intel-xeon")


def test_an_unknown_sample_is_refused_with_the_samples_named(tmp_path):
    with pytest.raises(ValueError, match=r"battery-budget\.html"):
        bench_document.sample_paths(["nothing.txt"], tmp_path)
