"""The extraction child process: `python -I -m npumoe.jobs.extract.child`, started in an empty folder.

Reads one JSON request on stdin ({"fd": inherited open file, "suffix": name hint, "limits": ExtractLimits}),
caps its own address space, parses the file and writes one JSON reply on stdout: the ExtractedText fields,
or {"kind", "message"} of an ExtractionError, or {"missing_dependency": message}. It imports only the
standard library and the parser it needs.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
from dataclasses import asdict

from ..errors import ExtractionError, MissingDependency
from ..files import check_size
from .formats import ExtractedText, ExtractLimits, extract_bytes


def main() -> None:
    request = json.load(sys.stdin)
    limits = ExtractLimits(**request["limits"])
    _cap_resources(limits.memory_mb)
    try:
        reply = asdict(_extract(request["fd"], request["suffix"], limits))
    except ExtractionError as err:
        reply = {"kind": err.kind, "message": str(err)}
    except MissingDependency as err:
        reply = {"missing_dependency": str(err), "module": err.module}
    except MemoryError:
        reply = {"kind": "memory", "message": f"extraction ran out of memory (limit {limits.memory_mb} MiB)"}
    sys.stdout.buffer.write(json.dumps(reply, ensure_ascii=False).encode("utf-8"))


def _cap_resources(memory_mb: int) -> None:
    memory = memory_mb * 2**20
    # macOS does not enforce RLIMIT_AS: there the parent's watch of the resident memory is the bound.
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    # A parser crashing on a large document should not leave a core file of the same size behind.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _extract(fd: int, suffix: str, limits: ExtractLimits) -> ExtractedText:
    with os.fdopen(fd, "rb") as file:
        data = file.read()  # sized by fstat; a file growing without end meets the memory cap
    check_size(len(data), limits.max_bytes, while_read=True, empty=False)  # truncated or grown since it was opened
    return extract_bytes(data, suffix, limits)


if __name__ == "__main__":
    main()
