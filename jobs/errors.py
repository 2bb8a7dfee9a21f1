"""The exceptions of the jobs layer, in one module that imports only the standard library.

The daemon catches these (and `npumoed status` runs without numpy), and the extraction child process
raises ExtractionError, so nothing here may pull in a heavy dependency.
"""

from __future__ import annotations

# What an extraction failure can be; the pipeline records the kind with the job.
# `no_text_layer`: a PDF of images only (a scan), which would need OCR. MISSING: the file is gone.
MISSING = "missing"
KINDS = frozenset({
    "encrypted", "corrupt", "unsupported", "empty", "no_text_layer", "too_large", "timeout", "memory", "unreadable",
    MISSING,
})


class ExtractionError(Exception):
    """Why a document yielded no text: `kind` is one of KINDS, str(err) a one-line message for people."""

    def __init__(self, kind: str, message: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown extraction error kind {kind!r}; expected one of {sorted(KINDS)}")
        message = " ".join(message.split())
        super().__init__(kind, message)
        self.kind = kind
        self.message = message

    def __str__(self) -> str:
        return self.message


class FileRefused(ExtractionError, ValueError):
    """A file not to be read, judged by jobs/files.py alone, for every reader (intake, the pipeline's copy,
    extraction); it travels to the job unchanged: `kind` is what the job records, str() the reason in words.

    Kinds: `missing` (gone), `unreadable` (not a regular file, no permission, or could not be opened),
    `too_large` (over the size limit, or grew past it while read), `empty` (0 bytes, where a reader needs text).
    `denied`: no permission, which a person may put right, so such a document is tried again.
    """

    def __init__(self, kind: str, message: str, *, denied: bool = False) -> None:
        super().__init__(kind, message)
        self.denied = denied


class MissingDependency(Exception):
    """A package extraction needs is not installed (or will not import): the machine's fault, not the document's,
    so the job is handed back without spending an attempt. `module` is the top-level module that is missing."""

    def __init__(self, message: str, module: str) -> None:
        super().__init__(message)
        self.module = module


class Stop(Exception):
    """Raised between steps when the job must wait (shutdown, its batch window closed): it goes back untouched."""

    def __init__(self, why: str = "the daemon is stopping") -> None:
        super().__init__(why)


class Lost(Exception):
    """The job is no longer this worker's (cancelled by the person, or reaped)."""


class ModelUnavailable(Exception):
    """The model could not be loaded: not the document's fault, so the job is handed back, not failed."""


class Failure(Exception):
    """Why this document did not get outputs; `kind` is recorded with the job."""

    def __init__(self, kind: str, message: str, *, retryable: bool = False, set_aside: bool = True) -> None:
        super().__init__(message)
        self.kind = kind
        self.retryable = retryable
        self.set_aside = set_aside  # once dead, move the original to failed/ (not when it is someone else's now)


class DatabaseUnusable(RuntimeError):
    """The queue database cannot be used as it is: damaged, from a newer npumoed, or SQLite is too old.

    str() is one line for people; restarting does not help, so the daemon exits with its own status.
    """


class IdentityInUse(RuntimeError):
    """Another live daemon on the shared queue has this daemon's machine identity and home: this one must not
    start, or each would take the other's jobs for its own."""
