"""`npumoed bench`: tables, JSON with the machine description, clear errors, and a fast --help."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from click.testing import CliRunner

from npumoe.bench.cli import bench


def test_bench_moe_prints_a_table_and_writes_machine_and_results(tmp_path):
    out = tmp_path / "results" / "moe.json"
    result = CliRunner().invoke(bench, ["moe", "--geometry", "64x8x2x32", "--tokens", "32", "--dtype", "fp32",
                                        "--threads", "1", "--warmup", "0", "--repeats", "1", "--min-seconds", "0",
                                        "--no-own-process", "--json", str(out)])
    assert result.exit_code == 0, result.output
    # "fp32" is the short spelling the option still takes; tables and results say "float32"
    assert "geometry 64x8x2x32, tokens 32, dtype float32" in result.output and "roofline" in result.output
    assert "host packing per layer call, every expert resident (64x8x2x32, 32 tokens, float32): pack " in \
        " ".join(result.output.split())
    data = json.loads(out.read_text())
    assert data["machine"]["threads"] == 1 and data["machine"]["copy_bandwidth_gbps"] > 0
    assert {"cpu", "torch", "torch_cpu_capability", "memory_gib", "omp_wait_policy", "cpu_governor",
            "load_average", "overloaded"} <= data["machine"].keys()
    assert data["settings"]["min_seconds"] == 0 and data["settings"]["own_process"] is False
    for row in data["results"]:
        assert row["impl"] == "roofline" or row["impl"].startswith(("transformers-", "npumoe-"))
        assert {"impl", "geometry", "tokens", "dtype", "threads", "tokens_per_s"} <= row.keys()


def test_bench_moe_names_an_unknown_geometry():
    result = CliRunner().invoke(bench, ["moe", "--geometry", "qwen9"])
    assert result.exit_code == 2
    assert "unknown geometry 'qwen9'" in result.output


def test_bench_prefill_prints_one_table_per_case():
    result = CliRunner().invoke(bench, ["prefill", "--geometry", "64x8x2x32", "--document-tokens", "64", "--chunk",
                                        "32", "--calibration-documents", "1", "--dtype", "fp32", "--threads", "1",
                                        "--warmup", "0", "--repeats", "1", "--min-seconds", "0", "--no-own-process"])
    assert result.exit_code == 0, result.output
    assert "geometry 64x8x2x32, layers 2, dtype float32, document_tokens 64, chunk_tokens 32" in result.output
    assert "npumoe-torch-static" in result.output


def test_bench_prefill_weights_puts_the_quantized_path_beside_the_engines_best_float_one():
    result = CliRunner().invoke(bench, ["prefill", "--geometry", "64x8x2x32", "--document-tokens", "64", "--chunk",
                                        "32", "--calibration-documents", "1", "--weights", "int8", "--threads", "1",
                                        "--warmup", "0", "--repeats", "3", "--min-seconds", "0", "--no-own-process"])
    assert result.exit_code == 0, result.output
    found = re.search(r"npumoe-cpu-int8: [0-9.]+× the engine's best exact path \(([0-9.]+)-([0-9.]+) round by round, "
                      r"relative error", result.output)
    assert found and float(found[1]) <= float(found[2]), result.output


def test_bench_fidelity_writes_the_plot_and_the_json(tmp_path, harbour, orchard):
    (tmp_path / "cal.txt").write_text(harbour)
    (tmp_path / "eval.txt").write_text(orchard)
    result = CliRunner().invoke(bench, [
        "fidelity", "--calibration-text", str(tmp_path / "cal.txt"), "--eval-text", str(tmp_path / "eval.txt"),
        "--scale", "0.5", "--scale", "2", "--chunk", "64", "--eval-tokens", "128", "--threads", "1",
        "--warmup", "0", "--repeats", "1", "--plot", str(tmp_path / "f.png"), "--json", str(tmp_path / "f.json"),
        "--family", "olmoe", "--layer-geometry", "64x8x2x32", "--layer-tokens", "16"])
    assert result.exit_code == 0, result.output
    assert "exact model" in result.output and "prune" in result.output
    assert "Weights format against the float model" in result.output and "One MoE layer" in result.output
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"
    rows = json.loads((tmp_path / "f.json").read_text())["results"]
    assert [row.get("capacity_scale") for row in rows if "section" not in row] == [None, 0.5, 0.5, 2.0, 2.0]
    # each format with the family's random output layer and with the readout fitted to the calibration text
    assert [(row["model"], row["head"], row["format"]) for row in rows if row.get("section") == "weights"] == [
        ("tiny olmoe", head, format) for head in ("random", "readout") for format in ("fp32", "bf16", "int8", "int4")]
    assert [(row["distribution"], row["format"]) for row in rows if row.get("section") == "layer"] == [
        (draw, format) for draw in ("gaussian", "heavy-weights", "heavy") for format in ("int8", "int4")]


def test_bench_fidelity_plot_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` sees when it is not installed
    result = CliRunner().invoke(bench, ["fidelity", "--plot", str(tmp_path / "f.png")])
    assert result.exit_code == 1
    assert "--plot needs matplotlib" in result.output and "pip install 'npumoed[plot]'" in result.output
    assert "exact model" not in result.output and not (tmp_path / "f.png").exists()  # refused before the run


def test_importing_the_bench_commands_does_not_import_torch():
    code = "import sys, npumoe.bench.cli; print('torch' in sys.modules)"
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "False"


def test_dtype_auto_is_the_float_dtype_weights_auto_measures_fastest_for_each_geometry(monkeypatch):
    from npumoe.bench.options import measured_dtypes, parse_geometries
    from npumoe.engine.loading import auto_weights

    asked = []

    def seconds(hidden, ffn):
        asked.append((hidden, ffn))
        return {"fp32": 2.0, "bf16": 1.0} if hidden == 64 else {"fp32": 1.0, "bf16": 2.0}

    monkeypatch.setattr(auto_weights, "float_seconds", seconds)
    geometries = parse_geometries(["64x8x2x32", "128x8x2x32"])
    assert measured_dtypes(["auto"], geometries) == ("bfloat16", "float32") and asked == [(64, 32), (128, 32)]
    assert measured_dtypes(["bfloat16", "auto"], geometries[:1]) == ("bfloat16",)  # each dtype once
    assert measured_dtypes(["float32"], geometries) == ("float32",) and len(asked) == 3  # nothing to measure
