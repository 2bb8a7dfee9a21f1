"""Loading Hugging Face MoE causal LMs from a local folder or the local HF cache (offline by default)."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .experts_layout import ExpertsLayout, LayoutError, is_experts_module, read_layout
from .vocabulary import BFLOAT16, DTYPES, FLOAT32

log = logging.getLogger(__name__)

TORCH_DTYPES = {FLOAT32: torch.float32, BFLOAT16: torch.bfloat16}  # the vocabulary's dtypes as torch's

# Bytes read from each end of a weight file for the fingerprint: enough to tell checkpoints apart,
# cheap enough for 60 GB models.
_FINGERPRINT_SPAN = 1 << 20


class ModelError(ValueError):
    """A model that cannot be found or is not one the engine can run."""


@dataclass(frozen=True)
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str  # what the user asked for: a folder name or a Hugging Face id
    path: Path  # the folder the weights were read from
    key: str  # stable id of model + weights: "<name>@<fingerprint>"
    streamed: bool = False  # read tensor by tensor (stream_load.py), not by transformers' from_pretrained

    @property
    def family(self) -> str:
        return self.model.config.model_type

    @property
    def context_tokens(self) -> int:
        return int(self.model.config.max_position_embeddings)


def load_model(
    ref: str | Path,
    *,
    trust_remote_code: bool = False,
    allow_download: bool = False,
    dtype: str = FLOAT32,
    experts: str = "eager",
    pack: bool = False,
    format: str | None = None,
    models_dir: Path | None = None,
) -> LoadedModel:
    """Load an MoE causal LM the engine can run, and its tokenizer, in eval mode.

    `ref` is a local folder or a Hugging Face id resolved from the local HF cache only, unless
    `allow_download`. `experts` is the transformers experts implementation to start with; the engine
    switches it to "npumoe" when it attaches.

    The weights are read one tensor at a time into memory of their own (stream_load.py). With `pack`, the routed
    experts go straight into the engine's CPU experts in `format` (None: float; "int8", "int4": quantized, taken
    from the files `npumoed model quantize` wrote under `models_dir` where they exist), which the engine's runtime
    then runs as they are: the model's own expert weights are placeholders. A checkpoint the streaming loader
    cannot read is loaded by transformers' from_pretrained, said in the log (its peak memory is higher).
    """
    if dtype not in DTYPES:
        raise ModelError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    path, name = _resolve(str(ref), allow_download=allow_download, trust_remote_code=trust_remote_code)
    try:
        model = _streamed(path, name, TORCH_DTYPES[dtype], trust_remote_code, experts, pack, format, models_dir)
    except ModelError as e:
        raise ModelError(f"{name}: {e}") from e
    streamed = model is not None
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=TORCH_DTYPES[dtype],
            trust_remote_code=trust_remote_code,
            local_files_only=True,
            experts_implementation=experts,
        ).eval()
        try:
            moe_layouts(model)  # the capability check: every routed-experts module in a layout the engine runs
        except ModelError as e:
            raise ModelError(f"{name}: {e}") from e
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, path=path, key=_key(name, path),
                       streamed=streamed)


def _streamed(path: Path, name: str, dtype: torch.dtype, trust_remote_code: bool, experts: str, pack: bool,
              format: str | None, models_dir: Path | None) -> PreTrainedModel | None:
    """The model read by the streaming loader; None, said in the log, when it cannot read this checkpoint."""
    from .quant_store import find_quantized
    from .stream_load import NotStreamable, stream_model

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    quantized = find_quantized(models_dir, path, format) if pack and format and models_dir is not None else None
    try:
        return stream_model(path, config, dtype, experts_implementation=experts, pack=pack, format=format,
                            quantized=quantized, trust_remote_code=trust_remote_code)
    except NotStreamable as e:
        log.info("%s: loaded by transformers' from_pretrained, not streamed tensor by tensor (peak memory higher): %s",
                 name, e)
        return None
    finally:
        if quantized is not None:
            quantized.close()


def model_key(ref: str | Path, *, trust_remote_code: bool = False, allow_download: bool = False) -> str:
    """The key `load_model(ref)` would give its model, without loading it."""
    path, name = _resolve(str(ref), allow_download=allow_download, trust_remote_code=trust_remote_code)
    return _key(name, path)


def _key(name: str, path: Path) -> str:
    return f"{name}@{fingerprint(path)}"


def moe_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's routed-experts modules, in forward order, as (qualified name, module); `ModelError` when
    it has none, or one whose layout the engine does not implement (`moe_layouts`)."""
    return [(name, module) for name, module, _ in moe_layouts(model)]


def moe_layouts(model: nn.Module) -> list[tuple[str, nn.Module, ExpertsLayout]]:
    """Each routed-experts module, in forward order, with its layout (experts_layout.read_layout)."""
    found = []
    for name, module in model.named_modules():
        if not is_experts_module(module):
            continue
        try:
            found.append((name, module, read_layout(name, module)))
        except LayoutError as e:
            raise ModelError(str(e)) from e
    if not found:
        raise ModelError(f"{type(model).__name__} has no routed-experts modules (none is wrapped by transformers' "
                         "experts interface), so it is not an MoE model the engine can run")
    return found


def fingerprint(path: Path) -> str:
    """A short digest of the config and the weight files (names, sizes and both ends of each file)."""
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for weights in sorted(path.glob("*.safetensors")):
        size = weights.stat().st_size
        digest.update(f"{weights.name}:{size}".encode())
        with weights.open("rb") as f:
            digest.update(f.read(_FINGERPRINT_SPAN))
            f.seek(max(0, size - _FINGERPRINT_SPAN))
            digest.update(f.read(_FINGERPRINT_SPAN))
    return digest.hexdigest()[:16]


def _resolve(ref: str, *, allow_download: bool, trust_remote_code: bool) -> tuple[Path, str]:
    """(folder holding config.json, display name) for a local folder or a Hugging Face id."""
    local = Path(ref).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ModelError(f"{ref}: folder has no config.json, so it is not a Hugging Face model folder")
        return local.resolve(), local.resolve().name
    if local.exists():
        raise ModelError(f"{ref}: is a file; expected a model folder or a Hugging Face id")
    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", *(["*.py"] if trust_remote_code else [])]
    try:
        snapshot = snapshot_download(ref, local_files_only=not allow_download, allow_patterns=patterns)
    except (LocalEntryNotFoundError, HFValidationError, HfHubHTTPError) as e:
        where = "" if allow_download else " nor in the local Hugging Face cache (downloads are off)"
        raise ModelError(f"{ref}: not a local model folder{where}: {e}") from e
    return Path(snapshot), ref
