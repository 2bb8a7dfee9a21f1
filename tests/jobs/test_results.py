"""A processed document's output folder: written whole from the run, and found again by a later attempt of the same
job only."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from stand_in_engine import StandInEngine

from npumoe.engine import EngineSettings
from npumoe.jobs.extract.formats import ExtractedText
from npumoe.jobs.files import Folders
from npumoe.jobs.outputs import read_text
from npumoe.jobs.queue.store import Job, Queue
from npumoe.jobs.results import Run, finished_output, write_outputs
from npumoe.jobs.summary_file import read_summary

TEXT = "The harbour ledger, read by the night clerk.\n\nA second paragraph about the tide."


@dataclass
class Measured:
    cpu_seconds: float = 1.25
    wall_seconds: float = 2.5
    energy_joules: float | None = None
    energy_source: str = "unavailable"


@pytest.fixture
def job(queue: Queue, inbox_folders: Folders, claim: Callable[..., Job]) -> Job:
    path = inbox_folders.inboxes[0] / "ledger.txt"
    path.write_text(TEXT)
    return claim(queue, path)


@pytest.fixture
def run() -> Run:
    engine = StandInEngine(chunks=2)
    result = engine.process(TEXT, on_progress=lambda p: None, check=lambda: None)
    return Run(EngineSettings(model="stand-in"), engine, ExtractedText(TEXT, "text", None), 0.125, result, Measured())


def test_the_folder_holds_the_summary_vectors_spans_text_and_meta_of_the_run(
    inbox_folders: Folders, job: Job, run: Run
) -> None:
    out = write_outputs(inbox_folders.outbox, job, run)
    summary = read_summary(out)
    assert (summary.title, summary.text) == ("ledger.txt", "The stand-in summary.")
    assert summary.facts == ("model `stand-in`", "2 chunks", "20 tokens")
    assert np.load(out / "embeddings.npy").shape == (3, 4) and np.load(out / "offsets.npy").shape == (2, 2)
    assert read_text(out) == TEXT
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["job_id"], meta["sha256"], meta["source"]) == (job.id, job.sha256, job.path)
    assert (meta["seconds"]["extract"], meta["seconds"]["total"], meta["cpu_seconds"]) == (0.125, 2.5, 1.25)
    assert meta["residency"] == {"accelerator_groups": 0, "cpu_groups": 0, "measured_on": None, "fallback": None}


def test_a_later_attempt_finds_the_folder_its_job_wrote(inbox_folders: Folders, job: Job, run: Run) -> None:
    outbox = inbox_folders.outbox
    assert finished_output(outbox, job) is None
    out = write_outputs(outbox, job, run)
    assert finished_output(outbox, job) == out


def test_a_folder_of_that_name_another_job_wrote_is_not_this_jobs(
    inbox_folders: Folders, job: Job, run: Run
) -> None:
    outbox = inbox_folders.outbox
    write_outputs(outbox, dataclasses.replace(job, id=job.id + 1), run)  # the same content, queued again since
    assert finished_output(outbox, job) is None
