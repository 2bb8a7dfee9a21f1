"""Loading a Hugging Face causal LM the engine can run (MoE or dense), streamed tensor by tensor where it can be."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..errors import ModelError
from ..moe.experts_layout import LayoutError
from ..moe.model_experts import expert_layouts
from ..vocabulary import BFLOAT16, DTYPES, FLOAT32
from .gguf_load import gguf_model, is_gguf
from .quant_store import find_quantized, quantized_folder
from .resolve import fingerprint, model_folder, model_key_of
from .stream_load import NotStreamable, stream_model

log = logging.getLogger(__name__)

TORCH_DTYPES = {FLOAT32: torch.float32, BFLOAT16: torch.bfloat16}  # the vocabulary's dtypes as torch's


@dataclass(frozen=True)
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str  # what the user asked for: a folder name, a GGUF file's name or a Hugging Face id
    path: Path  # the folder (or the GGUF file) the weights were read from
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
    """Load a causal LM the engine can run, and its tokenizer, in eval mode: an MoE model whose experts are in a
    layout the engine runs, or a dense one (its FFNs run as the engine's dense projections).

    `ref` is a local folder, a GGUF file (gguf_load.py) or a Hugging Face id resolved from the local HF cache only,
    unless `allow_download`. `experts` is the transformers experts implementation to start with; the engine
    switches it to "npumoe" when it attaches.

    The weights are read one tensor at a time into memory of their own (stream_load.py). With `pack`, the routed
    experts go straight into the engine's CPU experts in `format` (None: float; "int8", "int4": quantized, taken
    from the files `npumoed model quantize` wrote under `models_dir` where they exist; a GGUF file's experts
    converted by a load are written there too, for the next), which the engine's runtime
    then runs as they are: the model's own expert weights are placeholders. A checkpoint the streaming loader
    cannot read is loaded by transformers' from_pretrained, said in the log (its peak memory is higher).
    """
    if dtype not in DTYPES:
        raise ModelError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    path, name = model_folder(str(ref), allow_download=allow_download, trust_remote_code=trust_remote_code)
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
            expert_layouts(model)  # the capability check: every routed-experts module in a layout the engine runs
        except ModelError as e:
            raise ModelError(f"{name}: {e}") from e
    # a GGUF file's tokenizer and chat template are in its metadata, which transformers' GGUF mapping reads
    where, gguf_file = (path.parent, {"gguf_file": path.name}) if is_gguf(path) else (path, {})
    tokenizer = AutoTokenizer.from_pretrained(where, trust_remote_code=trust_remote_code, local_files_only=True,
                                              **gguf_file)
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, path=path, key=model_key_of(name, path),
                       streamed=streamed)


def _streamed(path: Path, name: str, dtype: torch.dtype, trust_remote_code: bool, experts: str, pack: bool,
              format: str | None, models_dir: Path | None) -> PreTrainedModel | None:
    """The model read by the streaming loader; None, said in the log, when it cannot read this checkpoint (a GGUF
    file it cannot read is an error: from_pretrained would widen all of it to float32)."""
    quantized = find_quantized(models_dir, path, format) if pack and format and models_dir is not None else None
    if is_gguf(path):
        # the experts a GGUF load converts are kept in the home's store, where the next load reads them
        keep = quantized_folder(models_dir, path, fingerprint(path), format) \
            if pack and format and models_dir is not None and quantized is None else None
        try:
            model = gguf_model(path, dtype, experts_implementation=experts, pack=pack, format=format,
                               quantized=quantized, keep=keep)
        except (NotStreamable, LayoutError) as e:
            raise ModelError(f"this GGUF file is not one the engine reads: {e}") from e
        finally:
            if quantized is not None:
                quantized.close()
        expert_layouts(model)  # the capability check, as stream_model makes it
        return model
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
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








