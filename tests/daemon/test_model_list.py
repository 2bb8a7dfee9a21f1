"""`npumoed model list`: the GGUF models already on the machine, and a name it prints running the daemon."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from support.gguf_stores import fake_home, hf_download, lmstudio_download, ollama_manifest, ollama_pull, tiny_ggufs

from npumoe.daemon.cli import main
from npumoe.engine.loading import gguf_summary

LIBRARY = ("registry.ollama.ai", "library")
MOE = "ollama:tiny-moe:latest"
LLAMA = "hf:org/Tiny-Llama-GGUF/tiny-llama-F16.gguf"
LMSTUDIO = "lmstudio:pub/Tiny-MoE-GGUF/tiny-moe-Q8_0.gguf"


@pytest.fixture(scope="module")
def ggufs(tiny, tmp_path_factory) -> dict[str, Path]:
    return tiny_ggufs(tiny("qwen3_moe"), tmp_path_factory.mktemp("ggufs"))


@pytest.fixture
def person(tmp_path, monkeypatch, ggufs) -> Path:
    """A home holding a tiny MoE in Ollama's store and in LM Studio's folder, a tiny llama in the HF cache."""
    home = fake_home(tmp_path, monkeypatch)
    ollama_pull(home / ".ollama/models", ggufs["qwen3moe"], *LIBRARY, "tiny-moe", "latest")
    hf_download(home / ".cache/huggingface/hub", "org/Tiny-Llama-GGUF", ggufs["llama"], "tiny-llama-F16.gguf")
    lmstudio_download(home / ".lmstudio/models", "pub/Tiny-MoE-GGUF/tiny-moe-Q8_0.gguf", ggufs["qwen3moe"])
    return home


@pytest.fixture
def summaries(monkeypatch) -> list[list[Path]]:
    """The files `model list` read a header of, each time it did."""
    read: list[list[Path]] = []
    summarize = gguf_summary.summarize
    monkeypatch.setattr(gguf_summary, "summarize", lambda files: read.append(list(files)) or summarize(files))
    return read


def invoke(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_model_list_shows_each_stores_model_with_the_name_to_configure(person, summaries):
    listed = json.loads(invoke("model", "list", "--json").output)
    rows = {row["name"]: row for row in listed["models"]}
    assert list(rows) == [MOE, LMSTUDIO, LLAMA]  # by store, then name
    assert len(summaries) == 3  # every header read
    moe = rows[MOE]
    assert (moe["store"], moe["architecture"], moe["quantization"], moe["runs"], moe["problem"]) == (
        "ollama", "qwen3moe", "Q8_0", True, None)
    assert moe["disk_bytes"] == Path(moe["files"][0]).stat().st_size > 0 and moe["parameters"] > 0
    assert moe["fits"] == ["fp32", "bf16", "int8", "int4"]  # a tiny model fits any machine in every format
    assert (rows[LLAMA]["architecture"], rows[LLAMA]["runs"], rows[LLAMA]["problem"]) == ("llama", True, None)
    assert str(person / ".ollama/models") in listed["searched"]

    lines = invoke("model", "list").output.splitlines()
    assert [line for line in lines if line and not line.startswith(" ")][:3] == [MOE, LMSTUDIO, LLAMA]
    facts = lines[lines.index(MOE) + 1]
    assert "qwen3moe · Q8_0" in facts and "runs" in facts and "fits here in fp32, bf16, int8, int4" in facts
    assert "llama · F16" in lines[lines.index(LLAMA) + 1] and "runs" in lines[lines.index(LLAMA) + 1]


def test_a_damaged_store_entry_is_listed_with_its_reason_not_a_traceback(person, ggufs, summaries):
    ollama_manifest(person / ".ollama/models", "{not json", *LIBRARY, "broken", "latest")
    garbage = person / ".lmstudio/models/pub/Bad-GGUF/bad.gguf"
    garbage.parent.mkdir(parents=True)
    garbage.write_bytes(ggufs["qwen3moe"].read_bytes()[:3000])  # a download cut short

    result = invoke("model", "list")
    assert result.exit_code == 0
    lines = result.output.splitlines()
    broken, bad = lines.index("ollama:broken:latest"), lines.index("lmstudio:pub/Bad-GGUF/bad.gguf")
    assert "does not run: manifest" in lines[broken + 1] and "cannot be read" in lines[broken + 1]
    assert "does not run: its GGUF header cannot be read" in lines[bad + 1]
    rows = {row["name"]: row for row in json.loads(invoke("model", "list", "--json").output)["models"]}
    assert rows["lmstudio:pub/Bad-GGUF/bad.gguf"]["runs"] is False and rows[MOE]["runs"] is True
    assert [garbage] in summaries  # it was read, and failed


def test_nothing_found_says_where_it_looked(tmp_path, monkeypatch):
    home = fake_home(tmp_path, monkeypatch)
    result = invoke("model", "list")
    assert result.exit_code == 0
    assert "No GGUF models found. Looked in:" in result.output
    for place in (home / ".ollama/models", home / ".lmstudio/models", home / ".cache/huggingface/hub"):
        assert str(place) in result.output.replace("\n", "")
    listed = json.loads(invoke("model", "list", "--json").output)
    assert (listed["models"], listed["unreadable"]) == ([], [])


def test_a_listed_name_is_taken_by_the_commands_that_take_a_model(person):
    sized = json.loads(invoke("model", "size", LMSTUDIO, "--json").output)
    assert sized["model"] == LMSTUDIO and sized["expert_parameters"] > 0
    result = CliRunner().invoke(main, ["model", "size", "ollama:no-such:model"])
    assert result.exit_code != 0 and "Ollama has no such model" in result.output


def test_dense_models_in_the_stores_are_listed_as_running(tmp_path, monkeypatch, ggufs):
    home = fake_home(tmp_path, monkeypatch)
    ollama_pull(home / ".ollama/models", ggufs["qwen3"], *LIBRARY, "tiny-qwen3", "latest")
    lmstudio_download(home / ".lmstudio/models", "pub/Tiny-Gemma-GGUF/tiny-gemma3-Q8_0.gguf", ggufs["gemma3"])
    hf_download(home / ".cache/huggingface/hub", "org/Tiny-Llama-GGUF", ggufs["llama"], "tiny-llama-F16.gguf")
    rows = json.loads(invoke("model", "list", "--json").output)["models"]
    assert [(row["architecture"], row["runs"], row["problem"]) for row in rows] == [
        ("qwen3", True, None), ("gemma3", True, None), ("llama", True, None)]
    lines = invoke("model", "list").output.splitlines()
    assert [line for line in lines if line.startswith("    ") and "does not run" in line] == []


# fp32 and auto (the Q8_0 file's experts kept in int8) on the MoE; the dense llama in fp32
@pytest.mark.parametrize(("store", "weights", "chosen"), [("ollama", "fp32", "fp32"), ("ollama", "auto", "int8"),
                                                          ("hf", "fp32", "fp32")])
def test_run_once_processes_a_document_with_a_name_model_list_printed(
    person: Path, home: Path, configure: Callable[[str], Path],
    npumoed: Callable[..., subprocess.CompletedProcess[str]], tmp_path: Path, store: str, weights: str, chosen: str,
) -> None:
    [name] = [row["name"] for row in json.loads(invoke("model", "list", "--json").output)["models"]
              if row["store"] == store]
    configure(f"""
[model]
name = "{name}"
weights = "{weights}"
chunk_tokens = 64
summary_tokens = 8

[scheduler]
max_foreground_load = 1.0  # other test runs share these cores; their load is not what this test is about
poll_seconds = 0.5

[cpu]
threads = 1
background_priority = false  # at SCHED_IDLE on a busy shared machine the test could starve
""")
    folder = tmp_path / "papers"
    folder.mkdir()
    (folder / "note.md").write_text("# A note\n\n" + "The harbour fills with boats each evening. " * 20)
    result = npumoed("run", "--once", "--inbox", str(folder))
    assert result.returncode == 0, result.stderr
    assert "1 done" in result.stdout
    [output] = (home / "outbox").iterdir()
    meta = json.loads((output / "meta.json").read_text())
    assert meta["model"] == name and meta["model_key"].startswith(f"{name}@"), meta
    assert meta["weights"] == chosen
    assert (output / "summary.md").read_text().strip()
