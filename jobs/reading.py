"""Reading a queued document: a private copy of it, hashed as it is taken, then the text of that copy.

Everything after the copy reads it, not the person's file, so the outputs describe exactly the content that was
hashed. A document that yields no text is the job's Failure; a fault of the machine on the way (an I/O error on the
inbox's disk, a full outbox, a missing package) is a MachineFault, which costs the job no attempt.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from .errors import ExtractionError, Failure, FileRefused
from .extract.isolated import ExtractedText, ExtractLimits, extract_text
from .faults import READ_FAULTS, machine_fault
from .files import Version, snapshot

# Extraction failures worth another try: the machine was busy or short of memory. The rest are
# properties of the document and would fail the same way again.
RETRYABLE_EXTRACTION = frozenset({"timeout", "memory"})


def copy_document(source: Path, work: Path, max_bytes: int) -> tuple[Path, str, Version]:
    """Copy `source` into the private folder `work`: the copy, its SHA-256 and the identity of the file read."""
    copy = work / f"document{_safe_suffix(source)}"
    try:
        sha256, identity = snapshot(source, copy, max_bytes)
    except OSError as e:  # reading the document failed (its folder's fault), or writing the copy (the home's)
        fault = machine_fault(e, source.parent if e.errno in READ_FAULTS else work.parent)
        if fault is None:
            raise
        raise fault from e
    except FileRefused as refused:
        raise _failure(refused) from refused
    return copy, sha256, identity


def extract(copy: Path, limits: ExtractLimits, check: Callable[[], None]) -> ExtractedText:
    """The text of `copy`, extracted in a child process within `limits`."""
    try:
        return extract_text(copy, limits)
    except ExtractionError as e:
        # A stop signal reaches the extractor too (Ctrl-C, or systemd signalling the whole group): then
        # its death is the stop's doing, not the document's, and the check hands the job back.
        check()
        raise _failure(e) from e


def _failure(error: ExtractionError) -> Failure:
    """The job's failure for a document that yielded no text, its kind and reason as they were raised. Retried
    when the machine was busy or short of memory, or a permission refused it (a person may put that right); a
    file gone is no longer anyone's to set aside."""
    denied = isinstance(error, FileRefused) and error.denied
    return Failure(error.kind, str(error), retryable=error.kind in RETRYABLE_EXTRACTION or denied,
                   set_aside=error.kind != "missing")


def _safe_suffix(path: Path) -> str:
    """The extension, kept as a hint for extraction, reduced to plain letters and digits."""
    suffix = re.sub(r"[^A-Za-z0-9]", "", path.suffix)[:16]
    return f".{suffix}" if suffix else ""
