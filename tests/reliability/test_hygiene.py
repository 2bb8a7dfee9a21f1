"""Hygiene: private files, no network unless a download was configured, no remote code unless asked for,
and config and plan files checked before the daemon uses them.

Network and file access are watched with the audit hook of audited_npumoed.py inside the real daemon process;
each claim is paired with a run where the hook does see what is claimed absent, so the check can fail.
"""

from __future__ import annotations

import json
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from audited_npumoed import run_audited
from daemon_toml import daemon_toml
from hostile_run import HostileRun

from npumoe.jobs.queue.store import Queue

DOCUMENT = "A short note about harbour lamps, kept so that the daemon has one thing to read.\n"
MARKER_CODE = """
import os
from pathlib import Path

from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

Path(os.environ["REMOTE_CODE_MARKER"]).write_text("the model folder's own Python code ran")


class MarkerConfig(Qwen3MoeConfig):
    pass


class MarkerModel(Qwen3MoeForCausalLM):
    config_class = MarkerConfig
"""


def private(path: Path) -> bool:
    return stat.S_IMODE(path.lstat().st_mode) & 0o077 == 0


def network(events: list[dict]) -> list[dict]:
    return [e for e in events if "address" in e]


@pytest.fixture
def one_document_home(tmp_path: Path) -> Callable[[str], Path]:
    """A home with one document in its inbox and a config whose [model] section is given."""

    def make(model: str) -> Path:
        home = tmp_path / "home"
        (home / "inbox").mkdir(parents=True)
        (home / "inbox" / "note.txt").write_text(DOCUMENT)
        (home / "config.toml").write_text(daemon_toml(model))
        return home

    return make


def jobs(home: Path) -> list:
    queue = Queue(home / "npumoed.db", read_only=True)
    try:
        return queue.list()
    finally:
        queue.close()


def test_database_outputs_logs_and_reasons_are_created_readable_by_the_user_only(hostile: HostileRun) -> None:
    home = hostile.home
    made = [*home.glob("npumoed.db*"), home / "npumoed.lock", *home.glob("failed/*.error.txt")]
    for folder in ("outbox", "logs"):
        made += [home / folder, *(home / folder).rglob("*")]
    made += [home / folder for folder in ("processed", "failed", "models", "plans", "compiled", "reports")]
    assert {p.name for p in made} >= {"npumoed.db", "npumoed.log", "summary.md", "meta.json", "embeddings.npy"}
    assert [str(p) for p in made if not private(p)] == []  # with the umask at 022, as most people's is


def test_the_daemon_makes_no_network_connection_over_a_whole_run(hostile: HostileRun) -> None:
    assert network(hostile.events) == []
    assert any(e["event"] == "open" for e in hostile.events)  # the hook did record the run


def test_a_model_missing_locally_is_not_downloaded_unless_downloads_are_allowed(
    one_document_home: Callable[[str], Path], tmp_path: Path
) -> None:
    home = one_document_home('name = "npumoed-tests/no-such-moe"')
    refused, events = run_audited(["run", "--once"], home=home, record=tmp_path / "offline.jsonl")
    assert refused.returncode == 1 and "downloads are off" in refused.stderr
    assert network(events) == []
    [job] = jobs(home)
    assert job.state == "queued"  # not the document's fault: handed back for when the model is there

    config = home / "config.toml"
    config.write_text(config.read_text().replace("[model]\n", "[model]\nallow_download = true\n"))
    allowed, events = run_audited(["run", "--once"], home=home, record=tmp_path / "online.jsonl")
    assert allowed.returncode == 1  # this machine is offline, but the daemon did try
    assert any("huggingface.co" in e["address"] for e in network(events))


def test_a_model_folder_s_own_code_runs_only_when_trust_remote_code_is_configured(
    one_document_home: Callable[[str], Path], tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "model-with-code"
    shutil.copytree(tiny_model, model)
    (model / "marker_code.py").write_text(MARKER_CODE)
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "marker_code.MarkerConfig",
                          "AutoModelForCausalLM": "marker_code.MarkerModel"}
    (model / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "remote-code-ran"
    monkeypatch.setenv("REMOTE_CODE_MARKER", str(marker))
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf-modules"))  # where transformers copies such code

    home = one_document_home(f'name = "{model}"')
    default, _ = run_audited(["run", "--once"], home=home, record=tmp_path / "default.jsonl")
    assert default.returncode == 0, default.stderr[-2000:]
    assert [job.state for job in jobs(home)] == ["done"] and not marker.exists()

    config_file = home / "config.toml"
    config_file.write_text(config_file.read_text().replace("[model]\n", "[model]\ntrust_remote_code = true\n"))
    (home / "inbox" / "second.txt").write_text(DOCUMENT + "A second one.\n")
    run_audited(["run", "--once"], home=home, record=tmp_path / "trusted.jsonl")
    assert marker.exists()  # so the first run would have shown it, had the code run


def test_an_invalid_config_stops_the_daemon_before_it_touches_anything(
    one_document_home: Callable[[str], Path], tmp_path: Path
) -> None:
    home = one_document_home('name = "demo"\nchunk_tokens = "many"')
    result, events = run_audited(["run", "--once"], home=home, record=tmp_path / "bad.jsonl")
    assert result.returncode == 2 and "model.chunk_tokens" in result.stderr and "integer" in result.stderr
    assert not (home / "npumoed.db").exists() and (home / "inbox" / "note.txt").exists()
    assert [e for e in events if e.get("write")] == []


def test_a_missing_plan_is_named_at_start_and_no_document_is_touched(
    one_document_home: Callable[[str], Path], tiny_model: Path, tmp_path: Path
) -> None:
    plan = tmp_path / "plans" / "never-made.json"
    home = one_document_home(f'name = "{tiny_model}"\nplan = "{plan}"')
    result, _ = run_audited(["run", "--once"], home=home, record=tmp_path / "no-plan.jsonl")
    assert result.returncode != 0 and "plan" in result.stderr and str(plan) in result.stderr
    assert (home / "inbox" / "note.txt").exists() and not list((home / "failed").glob("*"))
    assert not (home / "npumoed.db").exists() or jobs(home) == []


@pytest.mark.parametrize(
    "content, words",
    [("{not json", "cannot read plan"), ('{"format": "npumoe.expert-plan", "version": 99}', "version 99")],
    ids=["garbled", "future-version"],
)
def test_a_broken_plan_is_refused_with_its_fault_and_the_document_waits_unharmed(
    one_document_home: Callable[[str], Path], tiny_model: Path, tmp_path: Path, content: str, words: str
) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(content)
    home = one_document_home(f'name = "{tiny_model}"\nplan = "{plan}"')
    result, _ = run_audited(["run", "--once"], home=home, record=tmp_path / "broken-plan.jsonl")
    assert result.returncode == 1 and str(plan) in result.stderr and words in result.stderr
    [job] = jobs(home)
    assert (job.state, job.attempts) == ("queued", 0) and list((home / "outbox").iterdir()) == []
