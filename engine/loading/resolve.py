"""Which model a name means: a local folder, a GGUF file or a Hugging Face id in the local cache, and its stable
key."""

from __future__ import annotations

import hashlib
from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

from ..errors import ModelError
from .model_stores import GGUF_SUFFIX, is_store_name, store_file

# Bytes read from each end of a weight file for the fingerprint: enough to tell checkpoints apart,
# cheap enough for 60 GB models.
_FINGERPRINT_SPAN = 1 << 20


def model_folder(ref: str, *, allow_download: bool, trust_remote_code: bool) -> tuple[Path, str]:
    """(folder holding config.json, or the GGUF file; display name) for a local folder, a GGUF file, a model in a
    store (model_stores.py: `ollama:…`, `lmstudio:…`, `hf:…`, read where the store keeps it) or a Hugging Face id."""
    if is_store_name(ref):
        return store_file(ref), ref
    local = Path(ref).expanduser()
    if local.is_file() and local.suffix == GGUF_SUFFIX:
        return local.resolve(), local.name
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ModelError(f"{ref}: folder has no config.json, so it is not a Hugging Face model folder")
        return local.resolve(), local.resolve().name
    if local.exists():
        raise ModelError(f"{ref}: is a file; expected a model folder, a {GGUF_SUFFIX} file or a Hugging Face id")
    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", *(["*.py"] if trust_remote_code else [])]
    try:
        snapshot = snapshot_download(ref, local_files_only=not allow_download, allow_patterns=patterns)
    except (LocalEntryNotFoundError, HFValidationError, HfHubHTTPError) as e:
        where = "" if allow_download else " nor in the local Hugging Face cache (downloads are off)"
        raise ModelError(f"{ref}: not a local model folder{where}: {e}") from e
    return Path(snapshot), ref


def model_key(ref: str | Path, *, trust_remote_code: bool = False, allow_download: bool = False) -> str:
    """The key `load_model(ref)` would give its model, without loading it."""
    path, name = model_folder(str(ref), allow_download=allow_download, trust_remote_code=trust_remote_code)
    return model_key_of(name, path)


def model_key_of(name: str, path: Path) -> str:
    """The stable id of a resolved model: its name and the fingerprint of its folder."""
    return f"{name}@{fingerprint(path)}"


def fingerprint(path: Path) -> str:
    """A short digest of the config and the weight files (names, sizes and both ends of each file); of a GGUF
    file, of the file alone (its metadata, the config, is at its start)."""
    if path.is_file():
        digest, files = hashlib.sha256(), [path]
    else:
        digest, files = hashlib.sha256((path / "config.json").read_bytes()), sorted(path.glob("*.safetensors"))
    for weights in files:
        size = weights.stat().st_size
        digest.update(f"{weights.name}:{size}".encode())
        with weights.open("rb") as f:
            digest.update(f.read(_FINGERPRINT_SPAN))
            f.seek(max(0, size - _FINGERPRINT_SPAN))
            digest.update(f.read(_FINGERPRINT_SPAN))
    return digest.hexdigest()[:16]
