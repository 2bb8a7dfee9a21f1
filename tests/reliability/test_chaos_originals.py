"""Chaos with `originals = "delete"`: the real daemon, SIGKILLed at seeded random moments, while a person renames
queued files, drops copies of documents and deletes first copies, and same-named broken files in two folders fail
together (#43).

Every content is known before the run (a manifest of sha256s). At every kill, with the daemon dead, no content may
have gone from the inbox, processed/ and failed/ without complete outputs; at the end every good document has
exactly one done job and one complete output folder and no original left, and every broken one is dead with its
original in failed/. NPUMOED_CHAOS_SEED replays another schedule; NPUMOED_CHAOS_DOCUMENTS sets the count.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import documents
import pytest
from chaos_summary import Figures
from home_audit import incomplete, integrity
from test_crash_consistency import jobs_now

from npumoe.jobs.outputs import TMP_PREFIX

SEED = int(os.environ.get("NPUMOED_CHAOS_SEED", "43"))
DOCUMENTS = int(os.environ.get("NPUMOED_CHAOS_DOCUMENTS", "300"))
KILLS = 12
BROKEN_PAIRS = 3  # inbox/a/broken-<n>.pdf and inbox/b/broken-<n>.pdf, different contents, failing together


def files_under(*folders: Path) -> list[Path]:
    return [Path(root) / name for folder in folders for root, _, names in os.walk(folder) for name in names
            if not name.startswith(".")]


def sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:  # the daemon moved or deleted it meanwhile
        return None


def complete_outputs(home: Path) -> Counter[str]:
    """Output folders by the content their meta.json names."""
    found: Counter[str] = Counter()
    for folder in outbox_entries(home):
        if not folder.name.startswith(TMP_PREFIX):
            found[json.loads((folder / "meta.json").read_bytes())["sha256"]] += 1
    return found


def outbox_entries(home: Path) -> list[Path]:
    """What the outbox holds; nothing before the daemon's first start made it."""
    return list((home / "outbox").iterdir()) if (home / "outbox").is_dir() else []


def originals(home: Path) -> Counter[str]:
    """Every original's content, in the inbox, processed/ or failed/."""
    return Counter(sha256(p) for p in files_under(home / "inbox", home / "processed", home / "failed")
                   if not p.name.endswith(".error.txt"))


def gone_without_outputs(home: Path, good: set[str]) -> list[str]:
    """Good contents dropped so far that no original holds and no output folder records."""
    held, written = originals(home), complete_outputs(home)
    return sorted(sha for sha in good if not held[sha] and not written[sha])


def finished(home: Path, good: set[str], broken: set[str]) -> bool:
    jobs = jobs_now(home)
    done = {j.sha256 for j in jobs if j.state == "done"}
    dead = {j.sha256 for j in jobs if j.state == "dead"}
    return done >= good and dead >= broken and not files_under(home / "inbox")


class Person:
    """What a person does to the inbox between and during the daemon's lives, by a seeded generator."""

    def __init__(self, inbox: Path, staged: Path, rng: random.Random) -> None:
        self.inbox, self.staged, self.rng = inbox, staged, rng
        self.waiting = sorted(staged.iterdir())
        self.copies = 0
        self.acts: Counter[str] = Counter()

    def drop(self, count: int) -> None:
        batch, self.waiting = self.waiting[:count], self.waiting[count:]
        for path in batch:
            os.rename(path, self.inbox / path.name)  # whole at once, as a browser's download finishes
        self.acts["dropped"] += len(batch)

    def rename_some(self) -> None:
        for path in self.rng.sample(self._documents(), min(3, len(self._documents()))):
            self._act("renamed", lambda p=path: os.rename(p, p.with_name(f"{p.stem}-renamed{p.suffix}")))

    def copy_and_delete(self) -> None:
        for path in self.rng.sample(self._documents(), min(2, len(self._documents()))):
            self.copies += 1
            copy = self.inbox / "copies" / f"{self.copies:03d}-{path.name}"
            copy.parent.mkdir(exist_ok=True)
            hidden = copy.with_name(f".{copy.name}")
            try:
                shutil.copyfile(path, hidden)
            except FileNotFoundError:  # settled by the daemon meanwhile
                continue
            os.rename(hidden, copy)
            self.acts["copied"] += 1
            if self.rng.random() < 0.5:  # the first copy deleted while the copy waits
                self._act("first copy deleted", path.unlink)

    def _documents(self) -> list[Path]:
        return sorted(p for p in self.inbox.glob("doc-*") if p.is_file())

    def _act(self, what: str, act: Callable[[], object]) -> None:
        try:
            act()
        except FileNotFoundError:  # the daemon settled it first
            return
        self.acts[what] += 1


def kill_moment(rng: random.Random, home: Path, pid: int, wait_for: Callable[..., bool]) -> None:
    """While it starts, in the middle of a document, or just after an output folder appeared."""
    moment = rng.choice(("startup", "mid-document", "after-output"))
    if moment == "startup":
        time.sleep(rng.uniform(0.0, 4.0))
    elif moment == "mid-document":
        wait_for(lambda: any(j.state == "running" and j.worker_pid == pid for j in jobs_now(home)), timeout=60,
                 interval=0.05)
        time.sleep(rng.uniform(0.0, 1.5))
    else:
        before = len(outbox_entries(home))
        wait_for(lambda: len(outbox_entries(home)) > before, timeout=60, interval=0.02)
        time.sleep(rng.uniform(0.0, 0.05))


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_renamed_copied_and_deleted_originals_under_delete_lose_nothing_across_kills(
    home: Path,
    tmp_path: Path,
    daemon_config: Callable[..., Path],
    start_npumoed: Callable[..., Any],
    wait_for: Callable[..., bool],
    chaos_figures: Figures,
) -> None:
    daemon_config(originals="delete", max_attempts=KILLS + 2, summary_tokens=2)
    rng = random.Random(SEED)
    inbox, staged = home / "inbox", tmp_path / "staged"
    for folder in (inbox / "a", inbox / "b", staged):
        folder.mkdir(parents=True)
    manifest = documents.write(staged, range(DOCUMENTS))  # sha256 -> name: made before the run
    good = set(manifest)
    broken = set()
    for n in range(BROKEN_PAIRS):
        for side in ("a", "b"):
            data = f"%PDF-1.4\nbroken {side} {n}\n".encode()
            (inbox / side / f"broken-{n}.pdf").write_bytes(data)
            broken.add(hashlib.sha256(data).hexdigest())
    person = Person(inbox, staged, rng)
    person.drop(DOCUMENTS // 3)
    started = time.monotonic()

    for life in range(KILLS):
        daemon = start_npumoed("run")
        person.drop(rng.randint(DOCUMENTS // (2 * KILLS), DOCUMENTS // KILLS + 1))
        person.rename_some()
        person.copy_and_delete()
        kill_moment(rng, home, daemon.process.pid, wait_for)
        assert daemon.process.poll() is None, f"the daemon exited on its own:\n{daemon.output()}"
        os.kill(daemon.process.pid, signal.SIGKILL)
        daemon.process.wait(timeout=30)
        dropped = good - {sha for sha, name in manifest.items() if (staged / name).exists()}
        assert not (lost := gone_without_outputs(home, dropped)), f"after kill {life + 1}: {lost}"

    person.drop(DOCUMENTS)
    last = start_npumoed("run")
    assert wait_for(lambda: finished(home, good, broken), timeout=1800, interval=0.5), last.output()
    last.process.send_signal(signal.SIGTERM)
    assert last.process.wait(timeout=60) == 0, last.output()

    jobs = jobs_now(home)
    done = Counter(j.sha256 for j in jobs if j.state == "done")
    by_sha = {j.sha256: j for j in jobs if j.state == "done"}
    written, held = complete_outputs(home), originals(home)
    problems = [f"{manifest[sha]}: {done[sha]} done jobs, {written[sha]} output folders, {held[sha]} originals"
                for sha in good if (done[sha], written[sha], held[sha]) != (1, 1, 0)]
    problems += [f"{manifest[sha]}: {why}" for sha in good if done[sha] == 1
                 and (why := incomplete(Path(by_sha[sha].output_dir or ""), by_sha[sha]))]
    failed = Counter(sha256(p) for p in files_under(home / "failed") if not p.name.endswith(".error.txt"))
    problems += [f"broken {sha[:8]}: {failed[sha]} originals in failed/" for sha in broken if failed[sha] != 1]
    problems += [f"job #{j.id} for {j.path}: no such content was dropped" for j in jobs
                 if j.sha256 not in good | broken]
    problems += [str(p.relative_to(home)) for p in home.rglob(f"{TMP_PREFIX}*")]
    processed = sum((done[sha], written[sha]) == (1, 1) for sha in good)
    chaos_figures.add(f"originals deleted: seed {SEED}, {DOCUMENTS} documents, {dict(person.acts)}, "
                      f"{time.monotonic() - started:.0f} s", kills=KILLS, processed=processed,
                      duplicates=sum(written[sha] > 1 or done[sha] > 1 for sha in good),
                      losses=len(good) - processed)
    assert not problems, "\n".join(problems[:30])
    assert integrity(home / "npumoed.db") == "ok"
