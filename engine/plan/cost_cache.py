"""Where a backend's measured costs for a plan are kept: one JSON file per backend, machine and plan.

The machine is what changes the figures: the CPU's name and feature flags, the instruction-set ceilings set, the
OS, torch's version and the backend's own package's. What a run measures with (the experts' dtype and format, the
threads) is recorded in the costs themselves (`MeasuredCosts.conditions`): placing reads them only where they match.

Torch-free, so a command can tell whether costs are measured already without loading the engine.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from ..kernels.host import cpu_model, machine_fingerprint
from ..vocabulary import COREML
from .expert_plan import ExpertPlan
from .residency import MeasuredCosts


def machine() -> str:
    """This machine as measured costs name it."""
    return f"{cpu_model()} ({platform.system()} {platform.machine()})"


BACKEND_PACKAGES = {COREML: "coremltools"}  # a backend whose graphs another package builds and runs


def machine_digest(backend: str) -> str:
    """Costs measured under another CPU (or its flags, or an instruction-set ceiling), OS, torch or version of the
    backend's package do not hold here."""
    package = BACKEND_PACKAGES.get(backend)
    facts = {**machine_fingerprint(), "system": machine(), "release": platform.release(), "torch": version("torch"),
             "backend": f"{package} {_version(package)}" if package else ""}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:12]


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "absent"


def write_json(path: Path, data: object) -> None:
    """Replace the file whole (temporary file, then rename): a reader never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=".writing-", suffix=".json")
    with os.fdopen(fd, "w") as file:
        json.dump(data, file, indent=1)
    os.replace(partial, path)


@dataclass(frozen=True)
class CostCache:
    """Measured costs as JSON files in `folder`, one per backend, machine and plan."""

    folder: Path

    def path(self, backend: str, plan: ExpertPlan) -> Path:
        return self.folder / f"{backend}-{machine_digest(backend)}-{plan.digest()}.json"

    def get(self, backend: str, plan: ExpertPlan) -> MeasuredCosts | None:
        try:
            return MeasuredCosts.from_dict(json.loads(self.path(backend, plan).read_text()))
        except (OSError, ValueError, KeyError, TypeError):  # none yet, or not a file this version wrote
            return None

    def put(self, backend: str, plan: ExpertPlan, costs: MeasuredCosts) -> None:
        write_json(self.path(backend, plan), costs.to_dict())

    def everything(self) -> list[tuple[str, MeasuredCosts]]:
        """(file name, costs) of every readable file here, for reports."""
        found = []
        for path in sorted(self.folder.glob("*.json")):
            try:
                found.append((path.name, MeasuredCosts.from_dict(json.loads(path.read_text()))))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return found
