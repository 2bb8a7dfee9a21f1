"""Where the GGUF models a person already has lie, and the names npumoed gives them.

Three stores, each only read:
- Ollama's (`$OLLAMA_MODELS`, else `~/.ollama/models`; and the Linux service's `/usr/share/ollama/.ollama/models`):
  `manifests/<registry>/<namespace>/<model>/<tag>` is JSON whose layer of mediaType OLLAMA_MODEL_LAYER names the
  blob `blobs/sha256-<hex>`, a GGUF file with no suffix. Named as Ollama names it: `ollama:qwen3:30b-a3b`
  (registry.ollama.ai/library), `ollama:namespace/model:tag`, `ollama:hf.co/org/repo:tag`.
- LM Studio's (`~/.lmstudio/models`, older `~/.cache/lm-studio/models`, the data folder that
  `~/.lmstudio-home-pointer` names, and the `downloadsFolder` of a data folder's settings.json):
  `<publisher>/<repo>/<file>.gguf`, named `lmstudio:publisher/repo/file.gguf`.
- The Hugging Face cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `$XDG_CACHE_HOME` or `~/.cache`, then
  `huggingface/hub`): `models--org--name/snapshots/<revision>/<path>.gguf`, symlinks into `blobs/`; the revision
  `refs/main` points at, else the newest; named `hf:org/name/path.gguf`.

A name stays valid while the store keeps the model (an Ollama tag or a Hugging Face repository updated in place
resolves to its new file). A model split into parts (`-00001-of-00003.gguf`) is one entry, named by its first part.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelError

GGUF_SUFFIX = ".gguf"
OLLAMA, LMSTUDIO, HF = "ollama", "lmstudio", "hf"
STORES = (OLLAMA, LMSTUDIO, HF)
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")  # how Ollama names a layer, and its blob file
OLLAMA_SERVICE_MODELS = Path("/usr/share/ollama/.ollama/models")  # the Linux install script's `ollama` user
_OLLAMA_REGISTRY, _OLLAMA_NAMESPACE, _OLLAMA_TAG = "registry.ollama.ai", "library", "latest"
SPLIT_PART = re.compile(r"(?P<stem>.+)-(?P<part>\d{5})-of-(?P<parts>\d{5})\.gguf")


@dataclass(frozen=True)
class StoredModel:
    name: str  # what to put in `[model] name`
    store: str
    files: tuple[Path, ...]  # the file, or each part of a split one in order; empty when `problem` says why
    problem: str | None = None  # why the entry is unusable: a damaged manifest, a missing blob or part

    @property
    def split(self) -> bool:
        return len(self.files) > 1


@dataclass(frozen=True)
class Found:
    models: list[StoredModel]  # by store, then name
    searched: list[Path]  # every place looked in, whether it exists or not
    unreadable: list[str]  # "place: why" of each store that could not be read


def is_store_name(name: str) -> bool:
    return name.partition(":")[0] in STORES and ":" in name


def find_models() -> Found:
    """Every GGUF model in the stores of this user (and of Ollama's Linux service)."""
    ollama, lmstudio, hf = ollama_roots(), lmstudio_roots(), hf_hub_cache()
    scans = [*((root, _ollama_models) for root in ollama), *((root, _lmstudio_models) for root in lmstudio),
             (hf, _hf_models)]
    models: list[StoredModel] = []
    unreadable = []
    for root, scan in scans:
        try:
            models += scan(root)
        except OSError as e:  # another user's store (Ollama's service keeps its own)
            unreadable.append(f"{root}: {e}")
    first: dict[tuple[str, str], StoredModel] = {}
    for model in models:  # a name resolves to its first root: the same name further down is not that model
        first.setdefault((model.store, model.name), model)
    return Found(sorted(first.values(), key=lambda m: (STORES.index(m.store), m.name)), [*ollama, *lmstudio, hf],
                 unreadable)


def store_file(name: str) -> Path:
    """The file a store name (`ollama:…`, `lmstudio:…`, `hf:…`) stands for, where the store keeps it; ModelError
    when the store does not hold it, or holds it in parts the engine cannot read as one."""
    store, _, rest = name.partition(":")
    if store == OLLAMA:
        model = _ollama_model(rest)
    elif store == LMSTUDIO:
        model = _stored_file(LMSTUDIO, "", lmstudio_roots(), rest, 3)
    elif store == HF:
        org, _, rest_of_repo = rest.partition("/")
        repo, _, path = rest_of_repo.partition("/")
        snapshot = _hf_snapshot(hf_hub_cache() / f"models--{org}--{repo}") if org and repo else None
        model = _stored_file(HF, f"{org}/{repo}/", [snapshot] if snapshot else [], path, 1)
    else:
        raise ModelError(f"{name}: not a store name (ollama:, lmstudio: or hf:)")
    if model.problem:
        raise ModelError(f"{name}: {model.problem}")
    if model.split:
        raise ModelError(f"{name}: {split_reason(model)}")
    return model.files[0]


def split_reason(model: StoredModel) -> str:
    return (f"split into {len(model.files)} files, and the engine reads a GGUF model from one file (llama.cpp's "
            "`llama-gguf-split --merge` joins them)")


def ollama_roots() -> list[Path]:
    configured = os.environ.get("OLLAMA_MODELS")
    user = Path(configured).expanduser() if configured else Path.home() / ".ollama" / "models"
    return _unique([user, OLLAMA_SERVICE_MODELS])


def lmstudio_roots() -> list[Path]:
    """LM Studio's models folders: each data folder's configured downloads folder, then its `models`."""
    home = Path.home()
    data = [home / ".lmstudio", home / ".cache" / "lm-studio"]
    pointer = home / ".lmstudio-home-pointer"  # where LM Studio's data folder was moved to
    with contextlib.suppress(OSError, UnicodeDecodeError):  # no pointer (or none readable): the defaults
        if moved := pointer.read_text().strip():
            data.insert(0, Path(moved).expanduser())
    roots = []
    for folder in data:
        try:
            configured = json.loads((folder / "settings.json").read_text()).get("downloadsFolder")
        except (OSError, ValueError, AttributeError):
            configured = None  # no settings, or none LM Studio could have written: its default folder
        if isinstance(configured, str) and configured:
            roots.append(Path(configured).expanduser())
        roots.append(folder / "models")
    return _unique(roots)


def hf_hub_cache() -> Path:
    """The Hugging Face cache, read from the environment now (huggingface_hub reads it once, at import)."""
    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(cache).expanduser()
    if hf_home := os.environ.get("HF_HOME"):
        return Path(hf_home).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def _ollama_models(root: Path) -> list[StoredModel]:
    manifests = root / "manifests"
    return [_ollama_entry(root, manifest, _ollama_name(manifest.relative_to(manifests).parts))
            for manifest in sorted(manifests.glob("*/*/*/*")) if manifest.is_file()]


def _ollama_name(parts: tuple[str, ...]) -> str:
    """Ollama's own short name for manifests/<registry>/<namespace>/<model>/<tag>."""
    registry, namespace, model, tag = parts
    if registry != _OLLAMA_REGISTRY:
        return f"{registry}/{namespace}/{model}:{tag}"
    return f"{model}:{tag}" if namespace == _OLLAMA_NAMESPACE else f"{namespace}/{model}:{tag}"


def _ollama_model(name: str) -> StoredModel:
    """The model an Ollama name (`qwen3:30b-a3b`, `namespace/model`, `host/namespace/model:tag`) stands for."""
    base, colon, tag = name.rpartition(":")
    if not colon or "/" in tag:  # no tag (a colon there is a registry's port)
        base, tag = name, _OLLAMA_TAG
    parts = base.split("/")
    parts = [*[_OLLAMA_REGISTRY, _OLLAMA_NAMESPACE][:max(0, 3 - len(parts))], *parts]
    if len(parts) != 3 or any(p in ("", ".", "..") for p in (*parts, tag)):
        raise ModelError(f"ollama:{name}: not an Ollama model name (model:tag, namespace/model:tag or "
                         "registry/namespace/model:tag)")
    roots = ollama_roots()
    for root in roots:
        manifest = root / "manifests" / Path(*parts, tag)
        if manifest.is_file():
            return _ollama_entry(root, manifest, name)
    raise ModelError(f"ollama:{name}: Ollama has no such model (looked in {', '.join(map(str, roots))}; "
                     "`npumoed model list` shows the models it has)")


def _ollama_entry(root: Path, manifest: Path, name: str) -> StoredModel:
    """The model a manifest names, or what is wrong with it (it stays Ollama's: nothing is mended)."""
    full = f"{OLLAMA}:{name}"
    try:
        layers = json.loads(manifest.read_text()).get("layers")
        digests = [layer["digest"] for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_LAYER]
    except (OSError, ValueError) as e:
        return StoredModel(full, OLLAMA, (), f"manifest {manifest} cannot be read: {e}")
    except (AttributeError, TypeError, KeyError):
        return StoredModel(full, OLLAMA, (), f"manifest {manifest} is not one Ollama writes (no list of layers "
                                             "with a digest each)")
    if not digests or not isinstance(digests[0], str):
        return StoredModel(full, OLLAMA, (), f"manifest {manifest} has no model layer ({OLLAMA_MODEL_LAYER})")
    if not OLLAMA_DIGEST.fullmatch(digests[0]):  # it names a file: nothing but a digest may reach outside blobs/
        return StoredModel(full, OLLAMA, (), f"manifest {manifest} names its model layer by {digests[0]!r}, not a "
                                             "sha256 digest (sha256:<64 hex digits>)")
    blob = root / "blobs" / digests[0].replace(":", "-")
    if not blob.is_file():
        return StoredModel(full, OLLAMA, (), f"its model blob {blob} is missing (pulled only in part?)")
    return StoredModel(full, OLLAMA, (blob,))


def _grouped(store: str, root: Path, files: list[Path], prefix: str = "") -> list[StoredModel]:
    """One entry per model under `root`: a lone file, or the parts of a split one under the first part's name."""
    def name(path: Path) -> str:
        return f"{store}:{prefix}{path.relative_to(root).as_posix()}"

    entries = []
    for path in files:
        match = SPLIT_PART.fullmatch(path.name)
        if match is None:
            entries.append(StoredModel(name(path), store, (path,)) if path.exists() else
                           StoredModel(name(path), store, (), f"{path} is a link to a missing file "
                                                              "(an unfinished download?)"))
        elif int(match["part"]) == 1:
            entries.append(_split_model(name(path), store, path, int(match["parts"])))
    return entries


def _split_model(name: str, store: str, first: Path, count: int) -> StoredModel:
    stem = SPLIT_PART.fullmatch(first.name)["stem"]
    parts = tuple(first.with_name(f"{stem}-{i:05d}-of-{count:05d}{GGUF_SUFFIX}") for i in range(1, count + 1))
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        return StoredModel(name, store, (), f"split into {count} files, of which {', '.join(missing)} missing")
    return StoredModel(name, store, parts)


def _stored_file(store: str, prefix: str, roots: list[Path], relative: str, depth: int) -> StoredModel:
    """The model `relative` (at least `depth` folders and a file, no `..`) names in the first root holding it."""
    name = f"{store}:{prefix}{relative}"
    parts = relative.split("/")
    if len(parts) < depth or not parts[-1].endswith(GGUF_SUFFIX) or any(p in ("", ".", "..") for p in parts):
        shape = "publisher/repo/file.gguf" if store == LMSTUDIO else "org/name/file.gguf"
        raise ModelError(f"{name}: expected {store}:{shape}")
    for root in roots:
        path = root / relative
        if path.is_file() or path.is_symlink():
            match = SPLIT_PART.fullmatch(path.name)
            if match and int(match["part"]) != 1:
                raise ModelError(f"{name}: one part of a split model; its name is its first part's")
            return _grouped(store, root, [path], prefix)[0]
    where = ", ".join(map(str, roots)) or "no such repository in the Hugging Face cache"
    raise ModelError(f"{name}: not found ({where}; `npumoed model list` shows the models there are)")


def _lmstudio_models(root: Path) -> list[StoredModel]:
    return _grouped(LMSTUDIO, root, sorted(root.glob(f"*/*/*{GGUF_SUFFIX}")))


def _hf_models(cache: Path) -> list[StoredModel]:
    models = []
    for repo in sorted(cache.glob("models--*")):
        snapshot = _hf_snapshot(repo)
        if snapshot is not None:
            models += _grouped(HF, snapshot, sorted(snapshot.rglob(f"*{GGUF_SUFFIX}")), _hf_repo(repo))
    return models


def _hf_repo(folder: Path) -> str:
    """`org/name/` of a cache folder `models--org--name` (a repository name never holds `--`)."""
    return folder.name.removeprefix("models--").replace("--", "/") + "/"


def _hf_snapshot(repo: Path) -> Path | None:
    """The snapshot `refs/main` points at, else the newest one."""
    try:
        main = repo / "snapshots" / (repo / "refs" / "main").read_text().strip()
        if main.is_dir():
            return main
    except OSError:
        pass  # downloaded at a fixed revision only
    snapshots = [s for s in (repo / "snapshots").glob("*") if s.is_dir()]
    return max(snapshots, key=lambda s: s.stat().st_mtime) if snapshots else None


def _unique(paths: list[Path]) -> list[Path]:
    return list(dict.fromkeys(paths))
