"""A real `DocumentMeta`, as the pipeline writes it, for tests that need an output folder without running a model."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from npumoe.jobs.meta import DocumentMeta, Embeddings, Extraction, Residency, Seconds, SummaryCheck


def document_meta(**fields: Any) -> DocumentMeta:
    """A plausible meta.json for job 1 of a small text document, with `fields` set instead."""
    meta = DocumentMeta(
        source="/in/document.txt", sha256="0" * 64, job_id=1, model="m", model_key="m@main", plan=None,
        backend="cpu", overflow="spill", weights="fp32", dtype="float32", chunk_tokens=512,
        extraction=Extraction("text", None, 100), tokens=30, chunks=1, sections=1, reduce_rounds=0,
        generated_tokens=4, summary_check=SummaryCheck.of(()), embeddings=Embeddings(dim=8),
        residency=Residency(accelerator_groups=0, cpu_groups=0, measured_on=None, fallback=None),
        seconds=Seconds(extract=0.1, prefill=0.2, summary=0.3, reduce=0.0, engine=0.5, total=0.7),
        cpu_seconds=0.9, energy_joules=None, energy_source="unavailable", dispatch={}, npumoed_version="0",
        created_at="2026-11-30T01:02:03+00:00")
    return replace(meta, **fields)
