"""The engine run over one document's text, its progress recorded with the job, and its errors told apart: the
worker's own (a stop, a cancel, raised by the check within the engine) pass through; the engine's become the job's
Failure, retried unless the engine refused the input itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .errors import Failure, Lost, Stop
from .progress import JobProgress

if TYPE_CHECKING:
    from npumoe.engine import DocumentResult, Engine


def run_engine(engine: Engine, text: str, progress: JobProgress, check: Callable[[], None]) -> DocumentResult:
    """`engine.process(text)`, with `check` run before every model layer (it may block or raise)."""
    progress.model_loaded()
    try:
        return engine.process(text, on_progress=progress.engine_moved, check=check)
    except (Stop, Lost, Failure):
        raise
    except MemoryError as e:
        raise Failure("memory", "the model ran out of memory on this document", retryable=True) from e
    except ValueError as e:  # the engine's word for input it cannot take (empty text, for one)
        raise Failure("engine", f"the engine refused this document: {e}") from e
    except Exception as e:
        raise Failure("engine", f"the engine failed: {type(e).__name__}: {e}", retryable=True) from e
