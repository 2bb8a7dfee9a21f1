"""A processed document's output folder, `outbox/<stem>-<key16>/`: its five files made from what the run produced,
written as one folder at once (outputs.write_folder), and found again by a later attempt of the same job."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from .extract.isolated import ExtractedText
from .faults import blamed_on
from .meta import DocumentMeta, Embeddings, Extraction, Residency, Seconds, SummaryCheck, read_meta
from .outputs import (
    EMBEDDINGS_FILE,
    META_FILE,
    OFFSETS_FILE,
    SUMMARY_FILE,
    TEXT_FILE,
    compressed_text,
    npy_bytes,
    output_key,
    output_name,
    readable,
    write_folder,
)
from .queue.store import Job
from .summary_file import render_summary

if TYPE_CHECKING:
    from npumoe.engine import DocumentResult, Engine, EngineSettings


class Measurement(Protocol):
    cpu_seconds: float
    wall_seconds: float
    energy_joules: float | None
    energy_source: str


@dataclass(frozen=True)
class Run:
    """What processing one document produced, and what it cost."""

    settings: EngineSettings  # as configured
    engine: Engine  # as loaded
    extracted: ExtractedText
    extract_s: float
    result: DocumentResult
    meter: Measurement


def write_outputs(outbox: Path, job: Job, run: Run, *, mark: str = "") -> Path:
    """Write the output folder of `job` in `outbox`, replacing one of that name; a fault of the disk is the
    outbox's (faults.blamed_on). `mark`: the home's, on its temporary names (outputs.temporary_path)."""
    result = run.result
    files = {
        SUMMARY_FILE: render_summary(Path(job.path).name, run.settings.model, result.stats.chunks,
                                     result.stats.tokens, result.summary).encode(),
        EMBEDDINGS_FILE: npy_bytes(np.asarray(result.embeddings, dtype=np.float32)),
        OFFSETS_FILE: npy_bytes(np.asarray(result.spans, dtype=np.int64)),
        TEXT_FILE: compressed_text(run.extracted.text),
        META_FILE: document_meta(job, run).to_json(),
    }
    with blamed_on(outbox):
        return write_folder(outbox, _folder_name(job), files, mark=mark)


def finished_output(outbox: Path, job: Job) -> Path | None:
    """The output folder of `job` written whole in `outbox`, if any: by an earlier attempt that stopped before
    marking the job done, or by the run that did. Found by the job's keys, under whichever name its document had
    then (a file renamed after its outputs were written keeps one output folder)."""
    for out in sorted(outbox.glob(f"*-{output_key(job.sha256, job.model_key, job.settings_key)}")):
        try:
            meta = read_meta(out)
        except ValueError:
            continue
        if (meta["job_id"], meta["sha256"]) == (job.id, job.sha256):
            return out
    return None


def document_meta(job: Job, run: Run) -> DocumentMeta:
    settings, engine, stats, meter = run.settings, run.engine, run.result.stats, run.meter
    engine_s = {phase: round(seconds, 4) for phase, seconds in stats.seconds.items()}
    return DocumentMeta(
        source=readable(job.path),
        sha256=job.sha256,
        job_id=job.id,
        model=settings.model,
        model_key=engine.model_key,
        plan=str(settings.plan) if settings.plan else None,
        backend=settings.backend,
        overflow=settings.overflow,
        weights=engine.settings.weights,  # what the engine loaded: auto is decided at load
        dtype=engine.settings.dtype,
        chunk_tokens=stats.chunk_tokens,
        residency=_residency(engine),
        extraction=Extraction(run.extracted.format, run.extracted.pages, len(run.extracted.text)),
        tokens=stats.tokens,
        chunks=stats.chunks,
        sections=stats.sections,
        reduce_rounds=stats.reduce_rounds,
        generated_tokens=stats.generated_tokens,
        summary_check=SummaryCheck.of(stats.quality),
        embeddings=Embeddings(dim=int(run.result.embeddings.shape[1]), pooling=engine.settings.pooling),
        seconds=Seconds(extract=round(run.extract_s, 4), prefill=engine_s["prefill"], summary=engine_s["summary"],
                        reduce=engine_s["reduce"], engine=engine_s["total"], total=round(meter.wall_seconds, 4)),
        cpu_seconds=round(meter.cpu_seconds, 4),
        energy_joules=meter.energy_joules,
        energy_source=meter.energy_source,
        dispatch=stats.dispatch.to_dict(),
        npumoed_version=version("npumoed"),
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )


def _folder_name(job: Job) -> str:
    return output_name(Path(job.path).name, job.sha256, job.model_key, job.settings_key)


def _residency(engine: Engine) -> Residency:
    placed = engine.residency
    if placed is None:  # no plan: every expert on the exact CPU path
        return Residency(accelerator_groups=0, cpu_groups=0, measured_on=None, fallback=None)
    return Residency(accelerator_groups=placed.accelerator_groups, cpu_groups=placed.cpu_groups,
                     measured_on=placed.measured_on, fallback=placed.fallback)
