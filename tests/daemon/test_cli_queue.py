"""The queue commands as a person runs them: a real `npumoed` process on a fresh home."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from npumoe.jobs.queue.store import Queue


def npumoed(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NPUMOED_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "npumoe.daemon", *args], env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


def test_adding_a_file_twice_leaves_one_job(home: Path, tmp_path: Path) -> None:
    doc = tmp_path / "report.md"
    doc.write_text("# A report\n\nSome text.\n")
    assert npumoed(home, "add", str(doc)).returncode == 0
    second = npumoed(home, "add", str(doc))
    assert second.returncode == 0 and "already known" in second.stdout
    listed = json.loads(npumoed(home, "jobs", "--json").stdout)["jobs"]
    assert [(j["path"], j["state"]) for j in listed] == [(str(doc), "queued")]


def test_adding_a_folder_skips_hidden_and_partial_files(home: Path, tmp_path: Path) -> None:
    inbox = tmp_path / "docs"
    (inbox / "sub").mkdir(parents=True)
    for name, body in [("a.txt", "a"), ("sub/b.md", "b"), (".DS_Store", "x"), ("c.pdf.part", "c"),
                       ("~$d.docx", "d"), ("sub/e.crdownload", "e")]:
        (inbox / name).write_text(body)
    added = json.loads(npumoed(home, "add", "--json", str(inbox)).stdout)["jobs"]
    assert sorted(Path(j["path"]).name for j in added) == ["a.txt", "b.md"]


def test_cancel_then_retry(home: Path, tmp_path: Path) -> None:
    doc = tmp_path / "a.txt"
    doc.write_text("text")
    npumoed(home, "add", str(doc))
    assert npumoed(home, "cancel", "1").returncode == 0
    assert json.loads(npumoed(home, "jobs", "--json", "--state", "cancelled").stdout)["jobs"][0]["id"] == 1
    assert npumoed(home, "retry", "1").returncode == 0
    missing = npumoed(home, "retry", "42")
    assert missing.returncode == 1 and "no job 42" in missing.stderr


def test_a_file_name_with_escape_sequences_reaches_the_terminal_without_them(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # the `jobs` table shows the whole name
    doc = tmp_path / "notes\x1b]0;owned\x07\x1b[2J\x9b31m.txt"  # set the window title, clear the screen, a C1 CSI
    doc.write_text("text")
    shown = [npumoed(home, "add", str(doc)), npumoed(home, "jobs"), npumoed(home, "cancel", "1"),
             npumoed(home, "retry", "1")]
    assert [r.returncode for r in shown] == [0, 0, 0, 0]
    for result in shown:
        assert "notes" in result.stdout and not {"\x1b", "\x07", "\x9b"} & set(result.stdout + result.stderr)


def test_a_bad_config_exits_2_naming_the_problem(home: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nbackend = 'gpu'\n")
    result = npumoed(home, "--config", str(bad), "config", "show")
    assert result.returncode == 2
    assert str(bad) in result.stderr and "model.backend" in result.stderr


def test_config_show_prints_toml_that_reads_back(home: Path, tmp_path: Path) -> None:
    shown = npumoed(home, "config", "show")
    assert shown.returncode == 0
    echo = tmp_path / "echo.toml"
    echo.write_text(shown.stdout)
    assert npumoed(home, "--config", str(echo), "config", "show").stdout == shown.stdout
    # the one key for the weights' format, said plainly, and the old dtype key marked as what it is now
    assert ('weights = "auto"  # auto | fp32 | bf16 | int8 | int4; auto: chosen at load, `npumoed doctor` says what '
            'and why') in shown.stdout
    assert 'dtype = ""  # deprecated: weights decides the dtype' in shown.stdout


def test_the_queue_benchmark_reports_throughput_duplicates_and_losses(home: Path) -> None:
    result = npumoed(home, "bench", "queue", "--processes", "2", "--jobs", "40", "--rounds", "1")
    assert result.returncode == 0, result.stderr
    assert "jobs/s; duplicates 0, lost 0" in result.stdout


def test_jobs_prints_file_names_and_errors_that_look_like_markup_as_they_are(home: Path, tmp_path: Path) -> None:
    (tmp_path / "x[").mkdir()
    documents = [tmp_path / "Budget [draft].pdf", tmp_path / "x[" / "].pdf"]  # the second path ends `x[/].pdf`
    for doc in documents:
        doc.write_text(f"text of {doc.name}\n")
        assert npumoed(home, "add", str(doc)).returncode == 0
    queue = Queue(home / "npumoed.db")
    job = queue.claim(1, lease_seconds=60)
    assert job is not None
    queue.fail(job.id, 1, "cannot read [bold]x[/bold] or [/]", retryable=False)
    queue.close()
    listed = npumoed(home, "jobs")
    wide = subprocess.run([sys.executable, "-m", "npumoe.daemon", "jobs"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "NPUMOED_HOME": str(home), "COLUMNS": "400"})
    assert listed.returncode == 0 and "Traceback" not in listed.stderr
    assert wide.returncode == 0
    assert documents[0].name in wide.stdout and "].pdf" in wide.stdout and f"{tmp_path.name[-8:]}/x[" in wide.stdout
    assert "cannot read [bold]x[/bold] or [/]" in wide.stdout


def test_jobs_shows_each_file_name_whole_however_long_its_folder(home: Path, tmp_path: Path) -> None:
    folder = tmp_path / ("a-long-folder-name-" * 6) / "reports"
    folder.mkdir(parents=True)
    names = ["quarterly-review.pdf", "board-minutes.docx"]
    for name in names:
        (folder / name).write_text(f"text of {name}\n")
        assert npumoed(home, "add", str(folder / name)).returncode == 0
    narrow = subprocess.run([sys.executable, "-m", "npumoe.daemon", "jobs"], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "NPUMOED_HOME": str(home), "COLUMNS": "100"})
    assert narrow.returncode == 0
    for name in names:
        assert name in narrow.stdout
    assert "-name-/reports" in narrow.stdout  # and the end of the folder, where it is nearest the file
