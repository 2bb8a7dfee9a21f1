"""A queue database that cannot be used: found at start, one line and a status the service does not restart
on, and `npumoed doctor --rebuild-queue` gets the finished documents back from the outbox."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.postgres_server import PostgresServer
from support.sample_meta import document_meta

from npumoe.daemon.cli import main
from npumoe.daemon.cli.service import _database_check
from npumoe.daemon.config import Config, ModelConfig, OutboxConfig, QueueConfig
from npumoe.daemon.home import Home
from npumoe.daemon.intake import enqueue
from npumoe.daemon.model_choice import demo_model_dir
from npumoe.daemon.rebuild import keys_of, rebuild_queue
from npumoe.daemon.service import EXIT_DO_NOT_RESTART
from npumoe.jobs.errors import DatabaseUnusable
from npumoe.jobs.outputs import output_name
from npumoe.jobs.queue.dialects import check_sqlite_version
from npumoe.jobs.queue.schema import SCHEMA_VERSION
from npumoe.jobs.queue.store import Queue

PARAGRAPH = "The ledger was balanced at dawn, and the clerk wrote a line about every entry that did not fit.\n\n"


def damage(database: Path) -> None:
    """Overwrite the file header, as a disk fault or a stray write would: SQLite no longer knows the file."""
    with database.open("r+b") as file:
        file.write(b"\0" * 100)


def test_sqlite_older_than_3_35_is_refused_by_name() -> None:
    with pytest.raises(DatabaseUnusable, match=r"SQLite 3\.34\.1 is too old: npumoed needs 3\.35\.0 or newer"):
        check_sqlite_version((3, 34, 1))
    check_sqlite_version((3, 35, 0))


def test_quick_check_finds_a_damaged_page_at_open(tmp_path: Path) -> None:
    path = tmp_path / "q.db"
    queue = Queue(path)
    for n in range(300):  # several pages of jobs and index
        queue.add(f"/docs/{n}.txt", f"{n:064x}", model_key="m" * 200, settings_key="s")
    queue.close()
    data = bytearray(path.read_bytes())
    page = 4096
    data[3 * page:4 * page] = b"\x55" * page  # one page of the table's b-tree scribbled over
    path.write_bytes(data)
    with pytest.raises(DatabaseUnusable, match=r"^the database is damaged \(quick_check: [^\n]+\)$"):
        Queue(path)


def test_a_newer_schema_is_unusable_and_says_so(tmp_path: Path) -> None:
    path = tmp_path / "q.db"
    Queue(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(DatabaseUnusable, match="newer than this npumoed"):
        Queue(path)


@pytest.mark.slow  # a real daemon started on each kind of unusable database (make chaos); the checks are fast
@pytest.mark.parametrize("spoil", ["damaged", "newer"])
def test_npumoed_run_on_an_unusable_database_exits_78_with_one_line(
        home: Path, npumoed: Callable[..., object], spoil: str) -> None:
    Queue(Home(home).ensure().database).close()
    database = home / "npumoed.db"
    if spoil == "damaged":
        damage(database)
    else:
        with sqlite3.connect(database) as conn:
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    result = npumoed("run")
    assert result.returncode == EXIT_DO_NOT_RESTART == 78
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert lines[0].startswith(f"npumoed: cannot use the queue database {database}: ")
    assert ("damaged" if spoil == "damaged" else "newer than this npumoed") in lines[0]
    assert lines[0].endswith("`npumoed doctor` says how to recover")
    if spoil == "damaged":  # status reads the same file read-only and says the same
        status = npumoed("status")
        assert status.returncode == 78 and status.stderr.strip().splitlines() == lines
    doctor = npumoed("doctor")
    assert doctor.returncode == 1
    assert "queue database" in doctor.stdout and "npumoed doctor --rebuild-queue" in doctor.stdout


def test_status_reads_a_home_whose_path_has_hash_and_question_mark(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "odd #1 ?x=y %41"
    monkeypatch.setenv("NPUMOED_HOME", str(root))
    queue = Queue(Home(root).ensure().database)
    queue.add("/docs/a.txt", "a" * 64, model_key="m", settings_key="s")
    queue.close()
    result = CliRunner().invoke(main, ["status", "--json"], catch_exceptions=False)
    assert result.exit_code == 0
    assert json.loads(result.output)["queue"]["queued"] == 1
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("npumoed.db")) == [
        "npumoed.db", "npumoed.db-shm", "npumoed.db-wal"]  # nothing made under a name cut at `#` or `?`
    assert not any(p.name.startswith("odd #1 ") and p != root for p in tmp_path.iterdir())


# -- rebuilding from the outbox ------------------------------------------------------------------------

def write_output(home: Home, source: Path, job_id: int, model: str, *, outbox: Path | None = None,
                 **settings: object) -> Path:
    """A finished document's output folder as the pipeline writes it (into the home's outbox, or `outbox`), with a
    real DocumentMeta."""
    sha = hashlib.sha256(source.read_bytes()).hexdigest()
    meta = document_meta(source=str(source), sha256=sha, job_id=job_id, model=model, model_key=f"{model}@main",
                         plan=settings.get("plan"), backend=str(settings.get("backend", "cpu")),
                         weights=str(settings.get("weights", "fp32")))
    folder = (outbox or home.outbox) / output_name(source.name, sha, f"{model}@main", "settings")
    folder.mkdir(parents=True)
    (folder / "meta.json").write_bytes(meta.to_json())
    (folder / "summary.md").write_text("# summary\n")
    return folder


def test_rebuild_records_each_output_as_done_under_the_keys_a_new_add_would_use(tmp_path: Path) -> None:
    home = Home(tmp_path / "home").ensure()
    config = Config()  # the demo model on the cpu backend
    documents = []
    for name in ("Budget [draft].txt", "notes.txt", "other-backend.txt"):
        documents.append(tmp_path / name)
        documents[-1].write_text(PARAGRAPH + name)
    demo = str(demo_model_dir())
    today = [write_output(home, documents[0], 7, demo), write_output(home, documents[1], 9, demo)]
    write_output(home, documents[2], 12, demo, backend="torch-static")
    broken = home.outbox / "broken-00000000"
    broken.mkdir()
    (broken / "meta.json").write_text("{not json")
    leftover = home.outbox / ".tmp-notes-1234"  # a writer killed mid-way: never an output
    leftover.mkdir()
    (leftover / "meta.json").write_bytes((today[1] / "meta.json").read_bytes())

    queue = Queue(home.database)
    queue.add("/docs/waiting.txt", "f" * 64, model_key="demo", settings_key="s")
    queue.close()
    damage(home.database)

    rebuilt = rebuild_queue(home, config, stamp="20261130-010203")
    assert [p.name for p in rebuilt.moved_aside] == ["npumoed.db.damaged-20261130-010203"]
    assert rebuilt.moved_aside[0].exists()  # kept, not deleted
    assert (rebuilt.restored, rebuilt.known) == (3, 0)
    assert len(rebuilt.skipped) == 1 and rebuilt.skipped[0].startswith(f"{broken}: meta.json is not JSON")

    queue = Queue(home.database)
    done = {job.id: job for job in queue.list("done")}
    assert sorted(done) == [7, 9, 12]
    assert (done[7].path, done[7].output_dir) == (str(documents[0]), str(today[0]))
    assert queue.counts()["queued"] == 0  # waiting work comes back from the inbox rescan, not from here
    # The same content added again is the finished job, not new work ...
    for document, job_id in ((documents[0], 7), (documents[1], 9)):
        job, created = enqueue(queue, document, config)
        assert (job.id, job.state, created) == (job_id, "done", False)
    # ... unless it was made with other settings than today's: then it is processed again under today's.
    job, created = enqueue(queue, documents[2], config)
    assert created and job.state == "queued"
    assert rebuild_queue(home, config).known == 3  # running it again changes nothing
    queue.close()


def test_rebuild_matches_an_output_to_todays_keys_only_when_its_weights_format_is_todays(tmp_path: Path) -> None:
    home = Home(tmp_path / "home").ensure()
    document = tmp_path / "notes.txt"
    document.write_text(PARAGRAPH)
    meta = json.loads((write_output(home, document, 3, "m", weights="int8") / "meta.json").read_text())
    today = ("m", "today")
    for weights, same in (("int8", True), ("auto", True), ("bf16", False), ("int4", False)):
        config = Config(model=ModelConfig(name="m", weights=weights))
        assert (keys_of(meta, home, config, today) == today) is same, weights
    # An output from before meta.json recorded weights: its dtype's float format.
    older = {name: value for name, value in meta.items() if name != "weights"}
    assert keys_of(older, home, Config(model=ModelConfig(name="m", weights="fp32")), today) == today
    assert keys_of(older, home, Config(model=ModelConfig(name="m", weights="int8")), today) != today


def test_rebuild_with_a_sound_database_keeps_it_and_adds_what_is_missing(tmp_path: Path) -> None:
    home = Home(tmp_path / "home").ensure()
    document = tmp_path / "a.txt"
    document.write_text(PARAGRAPH)
    write_output(home, document, 3, str(demo_model_dir()))
    Queue(home.database).close()
    rebuilt = rebuild_queue(home, Config())
    assert (rebuilt.moved_aside, rebuilt.restored) == ([], 1)


def test_rebuild_reads_the_outbox_folder_the_config_names(tmp_path: Path) -> None:
    home = Home(tmp_path / "home").ensure()
    shared = tmp_path / "shared outbox"
    config = Config(outbox=OutboxConfig(folder=str(shared)))
    documents = [tmp_path / "a.txt", tmp_path / "b.txt"]
    for document in documents:
        document.write_text(PARAGRAPH + document.name)
    demo = str(demo_model_dir())
    there = write_output(home, documents[0], 3, demo, outbox=shared)
    write_output(home, documents[1], 4, demo)  # the home's own outbox, where this config sends nothing
    rebuilt = rebuild_queue(home, config)
    assert rebuilt.restored == 1
    queue = Queue(home.database)
    assert [(job.id, job.output_dir) for job in queue.list("done")] == [(3, str(there))]
    queue.close()


def test_doctor_rebuild_queue_refuses_while_the_daemon_holds_the_home(home: Path) -> None:
    from filelock import FileLock

    lock = FileLock(Home(home).ensure().lock)
    lock.acquire()
    try:
        result = CliRunner().invoke(main, ["doctor", "--rebuild-queue"])
    finally:
        lock.release()
    assert result.exit_code == 1 and "npumoed is running" in result.output


@pytest.mark.slow  # three lives of a real daemon (make chaos); the rebuild itself is tested by default
def test_the_real_daemon_damaged_then_rebuilt_does_not_process_its_documents_again(
        home: Path, configure: Callable[[str], Path], tiny_model: Path, npumoed: Callable[..., object]) -> None:
    configure(f"""
[model]
name = "{tiny_model}"
chunk_tokens = 64
summary_tokens = 4

[scheduler]
max_foreground_load = 1.0  # other test runs share these cores; their load is not what this test is about

[cpu]
threads = 1
background_priority = false
""")
    inbox = Home(home).ensure().inbox
    (inbox / "x[").mkdir()
    for name in ("Budget [draft].md", "x[/].md"):  # the second: `].md` in a folder `x[`
        (inbox / name).write_text(PARAGRAPH * 3 + name)
    first = npumoed("run", "--once")
    assert first.returncode == 0, first.stderr
    queue = Queue(home / "npumoed.db", read_only=True)
    before = sorted((j.id, j.sha256, j.path, j.output_dir) for j in queue.list("done"))
    queue.close()
    assert len(before) == 2

    damage(home / "npumoed.db")
    refused = npumoed("run", "--once")
    assert refused.returncode == 78 and len(refused.stderr.strip().splitlines()) == 1

    rebuilt = npumoed("doctor", "--rebuild-queue")
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert "2 finished document(s) recorded as done again" in rebuilt.stdout
    assert "2 in the search index" in rebuilt.stdout  # the index was in the damaged file too
    again = npumoed("run", "--once")
    assert again.returncode == 0, again.stderr
    assert "nothing to do" in again.stdout  # both inbox files were recognised as finished
    queue = Queue(home / "npumoed.db", read_only=True)
    after = sorted((j.id, j.sha256, j.path, j.output_dir) for j in queue.list())
    queue.close()
    assert after == before


def test_doctor_checks_the_queue_server_not_the_home_file_when_the_queue_is_on_postgresql(
    tmp_path: Path, postgres: PostgresServer
) -> None:
    home = Home(tmp_path / "home")
    home.root.mkdir()
    home.database.write_bytes(b"not a database")  # the home's own file, which a shared queue does not use
    url = postgres.new_database()
    Queue(url).close()
    check = _database_check(Config(queue=QueueConfig(url=url)), home)
    assert check["status"] == "ok" and f"schema v{SCHEMA_VERSION}" in check["detail"]
    assert check["detail"].startswith("postgresql://") and str(home.database) not in check["detail"]
    unreachable = _database_check(Config(queue=QueueConfig(url="postgresql://npumoed:pw@/q?host=/nowhere")), home)
    assert unreachable["status"] == "fail" and "cannot reach" in unreachable["detail"]
    assert "pw" not in unreachable["detail"]
