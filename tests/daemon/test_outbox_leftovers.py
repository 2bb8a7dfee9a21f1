"""What a killed run leaves in a configured `[outbox] folder`, which other homes may share: a start sweeps this home's
own temporary names there, puts back an output folder a killed replace set aside, and leaves other homes' alone
(#43, finding 6)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from npumoe.daemon.config import Config, CpuConfig, OutboxConfig
from npumoe.daemon.home import Home
from npumoe.daemon.worker import Worker
from npumoe.jobs.queue.store import Queue


def killed_while_replacing(outbox: Path, name: str, mark: str) -> None:
    """A writer replacing `outbox/name`, killed (no clean-up of its own) between its two renames."""
    code = textwrap.dedent(f"""
        import os
        from pathlib import Path
        from npumoe.jobs.outputs import write_folder
        real, renames = os.rename, []
        def rename(source, target):
            renames.append(source)
            if len(renames) == 2:
                os._exit(9)
            real(source, target)
        os.rename = rename
        write_folder(Path({str(outbox)!r}), {name!r}, {{"meta.json": b"new"}}, mark={mark!r})
    """)
    assert subprocess.run([sys.executable, "-c", code]).returncode == 9


def test_a_start_sweeps_its_own_leftovers_from_a_shared_outbox_and_leaves_other_homes_alone(
    npumoed_home: Home, queue: Queue, tmp_path: Path
) -> None:
    shared = tmp_path / "shared-outbox"
    shared.mkdir()
    config = Config(outbox=OutboxConfig(folder=str(shared)), cpu=CpuConfig(threads=1, background_priority=False))
    worker = Worker(config, npumoed_home, queue, once=True)
    mark = worker.folders.mark
    assert mark  # this home's, in a folder other homes may share

    (shared / "doc-0123456789abcdef").mkdir()
    (shared / "doc-0123456789abcdef" / "meta.json").write_bytes(b"old")
    killed_while_replacing(shared, "doc-0123456789abcdef", mark)  # leaves the old folder set aside, and the new one
    another_home = shared / ".tmp-0badc0de-report-0123456789abcdef-1234abcd"  # in flight on another machine
    another_home.mkdir()
    assert len(list(shared.iterdir())) == 3
    (npumoed_home.root / ".tmp-job1-deadbeef").mkdir()  # a killed job's copy of its document, in the home

    worker.run()

    assert sorted(p.name for p in shared.iterdir()) == sorted([another_home.name, "doc-0123456789abcdef"])
    assert (shared / "doc-0123456789abcdef" / "meta.json").read_bytes() == b"old"  # put back
    assert not (npumoed_home.root / ".tmp-job1-deadbeef").exists()
