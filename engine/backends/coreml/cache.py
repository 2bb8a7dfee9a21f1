"""Where compiled Core ML expert packages live, and the manifest that says what each function is.

A build goes to `<root>/<model>/<plan digest>/coremltools-<version>/` (`coremltools-<version>-int8/` and
`-int4/` for compressed weights), so a new checkpoint, a new plan, a new converter or another weights
format each get their own folder and never read a stale one or one of another format. The manifest is
written last: a folder without one is an unfinished build and is never loaded. A build, and compiling
a package for this macOS, hold a lock file beside their folder: a second process asking for the same
one waits, then finds it finished.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from filelock import FileLock

from .compress import FP16, check_format

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
    weights: str  # `weights_fingerprint` of the experts' (gate_up, down): how a backend finds this function
    scale: float = 1.0  # the function computes the group's values / scale, to stay in fp16's range

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
    weights: str = FP16  # the format its weights are stored in (compress.py); builds before formats are fp16

    def to_json(self) -> str:
        return json.dumps({"version": MANIFEST_VERSION, **asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        if data.pop("version", None) != MANIFEST_VERSION:
            raise ValueError(f"compiled-package manifest is not version {MANIFEST_VERSION}")
        groups = tuple(CompiledGroup(**{**g, "experts": tuple(g["experts"])}) for g in data.pop("groups"))
        return cls(groups=groups, **data)


def weights_fingerprint(gate_up: torch.Tensor, down: torch.Tensor, samples: int = 4096) -> str:
    """A digest of a group's weights: their shapes and `samples` evenly spaced values of each.

    Values are rounded to bfloat16 first, so a float32 and a bfloat16 load of one checkpoint agree;
    sampling keeps it cheap for 30B models while still telling any two groups apart.
    """
    digest = hashlib.sha256()
    for weight in (gate_up, down):
        flat = weight.detach().reshape(-1)
        n = min(samples, flat.numel())
        picks = torch.arange(n) * (flat.numel() - 1) // max(n - 1, 1)  # integer steps: exact at any size
        digest.update(repr(tuple(weight.shape)).encode())
        digest.update(flat[picks].to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]


def build_folder(root: Path, model: str, plan_digest: str, coremltools_version: str,
                 weights_format: str = FP16) -> Path:
    """The folder for one (model, plan, coremltools, weights format) build under the cache root."""
    return root / _slug(model) / plan_digest / _converter_folder(coremltools_version, weights_format)


def folder_lock(folder: Path) -> FileLock:
    """The lock a process holds while it builds `folder` (a file beside it, so the build can be renamed in)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(folder.with_name(f".{folder.name}.lock"))


def build_once(folder: Path, build: Callable[[], Manifest], *, force: bool = False) -> tuple[Manifest, bool]:
    """(the finished build in `folder`, whether it was there already): `build()` makes it unless it is (or
    `force`). Under the folder's lock, so two processes asking for one build never both write it."""
    with folder_lock(folder):
        manifest = None if force else read_manifest(folder)
        if manifest is not None:
            return manifest, True
        return build(), False


def read_manifest(folder: Path) -> Manifest | None:
    """The finished build's manifest, or None when the folder holds no finished build."""
    path = folder / MANIFEST
    return Manifest.from_json(path.read_text()) if path.is_file() else None


def compiled_groups(root: Path, coremltools_version: str,
                    weights_format: str = FP16) -> dict[tuple[str, int], tuple[Path, CompiledGroup]]:
    """(weights fingerprint, capacity) -> (build folder, group) over every finished build under `root`
    made with this coremltools version in this weights format: how a backend finds the graph for a group it is
    handed."""
    found = {}
    folder = _converter_folder(coremltools_version, weights_format)
    for manifest_path in sorted(root.glob(f"*/*/{folder}/{MANIFEST}")):
        manifest = read_manifest(manifest_path.parent)
        if manifest is None or manifest.weights != weights_format:
            continue
        for group in manifest.groups:
            found[(group.weights, group.capacity)] = (manifest_path.parent, group)
    return found


def _converter_folder(coremltools_version: str, weights_format: str) -> str:
    """A build's last folder: the converter's version, and the weights format unless fp16 (whose builds came first)."""
    check_format(weights_format)
    suffix = "" if weights_format == FP16 else f"-{weights_format}"
    return f"coremltools-{coremltools_version}{suffix}"


def _slug(model: str) -> str:
    """A model key ("Qwen/Qwen3-30B-A3B@ab12...") as one safe folder name."""
    return re.sub(r"[^A-Za-z0-9._@-]+", "_", model).strip("._") or "model"
