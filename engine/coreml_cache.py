"""Where compiled Core ML expert packages live, and the manifest that says what each function is.

A build goes to `<root>/<model>/<plan digest>/coremltools-<version>/`, so a new checkpoint, a new
plan or a new converter each get their own folder and never read a stale one. The manifest is
written last: a folder without one is an unfinished build and is never loaded.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
INPUT_NAME = "x"  # every function takes x (1, G*H, 1, C) fp16 ...
OUTPUT_NAME = "y"  # ... and returns y (1, G*H, 1, C) fp16


@dataclass(frozen=True)
class CompiledGroup:
    """One static group graph: a function of one multifunction package."""

    function: str
    package: str  # file name of the .mlpackage inside the build folder
    layer: int
    capacity: int  # C, tokens per expert
    experts: tuple[int, ...]  # the experts of the layer this graph runs, in channel-block order

    def input_shape(self, hidden: int) -> tuple[int, int, int, int]:
        return (1, len(self.experts) * hidden, 1, self.capacity)


@dataclass(frozen=True)
class Manifest:
    model: str
    plan: str  # the plan's digest
    coremltools: str
    hidden: int
    intermediate: int
    act: str
    groups: tuple[CompiledGroup, ...]
    package_bytes: dict[str, int]  # package file name -> size on disk

    def to_json(self) -> str:
        return json.dumps({"version": MANIFEST_VERSION, **asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        if data.pop("version", None) != MANIFEST_VERSION:
            raise ValueError(f"compiled-package manifest is not version {MANIFEST_VERSION}")
        groups = tuple(CompiledGroup(**{**g, "experts": tuple(g["experts"])}) for g in data.pop("groups"))
        return cls(groups=groups, **data)


def build_folder(root: Path, model: str, plan_digest: str, coremltools_version: str) -> Path:
    """The folder for one (model, plan, coremltools) build under the cache root."""
    return root / _slug(model) / plan_digest / f"coremltools-{coremltools_version}"


def read_manifest(folder: Path) -> Manifest | None:
    """The finished build's manifest, or None when the folder holds no finished build."""
    path = folder / MANIFEST
    return Manifest.from_json(path.read_text()) if path.is_file() else None


def _slug(model: str) -> str:
    """A model key ("Qwen/Qwen3-30B-A3B@ab12...") as one safe folder name."""
    return re.sub(r"[^A-Za-z0-9._@-]+", "_", model).strip("._") or "model"
