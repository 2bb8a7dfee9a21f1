"""Loading a GGUF file (llama.cpp's, Ollama's, LM Studio's) tensor by tensor, the routed experts expert by expert.

transformers' `from_pretrained(gguf_file=…)` dequantizes every tensor of the file to float32 before it builds the
model: about 122 GB for Qwen3-30B-A3B in Q4_K_M, an 18 GB file. Here instead:

- the config and the tokenizer come from the file's metadata through transformers' own GGUF mappings (with the
  expert width its qwen3moe and qwen2moe mappings do not read, taken from the file);
- the model is built on the meta device, and each GGUF name mapped to the model's parameter by transformers' own
  map (`get_gguf_hf_weights_map`, with its architecture's tensor processor for llama's permuted query and key);
- every tensor is read into memory of its own (`os.preadv`: the gguf package's reader maps the file, which is
  used for its header only); a weight other than the routed experts is converted to float one at a time;
- each routed expert's gate, up and down projections are read from the stacked `ffn_*_exps` tensors and put in
  the engine's form one expert at a time (gguf_blocks.py: Q8_0, Q4_0 and Q4_1 straight into int8 or int4,
  other types dequantized and quantized again), then packed into the engine's CPU experts with `pack`, or
  written into the module's float parameters without it.

A file this loader cannot read (experts in a layout it does not map, tensors the model has no place for)
raises stream_load.NotStreamable before the experts are read.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

from ..formats.gguf_blocks import dequantized, engine_weight
from ..formats.quantize import QuantizedWeight, stack_rows
from ..moe.cpu_experts import CpuExperts, Expert
from ..moe.experts_layout import ExpertsLayout, is_experts_module, read_layout
from .resolve import GGUF_SUFFIX
from .stream_load import NotStreamable, attach_packed, finish_loading, put_tensor
from .tensor_reader import read_into

# transformers' model types and the GGUF architecture names llama.cpp writes for them
GGUF_ARCHITECTURES = {"llama": "llama", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe"}
EXPERTS_TENSOR = re.compile(r"(?P<stem>.*\.ffn_(?P<part>gate|up|down)_exps)\.weight")
GGUF_MAGIC = b"GGUF"
_PARTS = {"gate": ("gate_up_proj", 0), "up": ("gate_up_proj", 1), "down": ("down_proj", 0)}


def is_gguf(path: Path) -> bool:
    """A GGUF file: by its suffix, or by its magic where a store keeps it without one (Ollama's blobs, and the
    Hugging Face cache's blobs a snapshot's link resolves to)."""
    if not path.is_file():
        return False
    if path.suffix == GGUF_SUFFIX:
        return True
    try:
        with path.open("rb") as file:
            return file.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:
        return False


def gguf_config(path: Path) -> PretrainedConfig:
    """The model's config from the file's metadata, as transformers reads it, with the expert width it misses."""
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    width = reader.fields.get(f"{arch}.expert_feed_forward_length")
    if width is not None and hasattr(config, "moe_intermediate_size"):
        config.moe_intermediate_size = int(width.contents())
    return config


def gguf_model(path: Path, dtype: torch.dtype, *, experts_implementation: str, pack: bool = False,
               format: str | None = None) -> PreTrainedModel:
    """The model in the GGUF file `path`, its float weights in `dtype`. With `pack`, every experts module's
    weights go straight into the engine's CPU experts in `format` (None: float). experts_layout.LayoutError for
    experts the engine does not run."""
    config = gguf_config(path)
    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation=experts_implementation)
    # a dense model (llama) loads too: whether the engine runs it is the caller's check (models.moe_layouts)
    layouts = {name: read_layout(name, module) for name, module in model.named_modules() if is_experts_module(module)}
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)
    experts: dict[str, dict[tuple[str, int], gguf.ReaderTensor]] = defaultdict(dict)
    with path.open("rb") as file:
        for tensor in reader.tensors:
            if match := EXPERTS_TENSOR.fullmatch(tensor.name):
                module = names.get(match["stem"], "").rpartition(".")[0]
                if module not in layouts or layouts[module].transposed or layouts[module].interleaved \
                        or layouts[module].bias:
                    raise NotStreamable(f"its experts tensor {tensor.name} is not in a layout the loader maps")
                experts[module][_PARTS[match["part"]]] = tensor
                continue
            target = names.get(tensor.name)
            if target is None:
                continue  # a tensor the model has no place for: transformers drops it too
            values = dequantized(_read(file, tensor), tensor.tensor_type).reshape(gguf_shape(tensor))
            values = processor.process(weights=values, name=tensor.name).weights
            put_tensor(model, target, torch.from_numpy(np.ascontiguousarray(values)))
        for name, tensors in experts.items():
            module = model.get_submodule(name)
            if pack:
                weights = _experts(file, tensors, format, dtype)
                cpu = CpuExperts.streamed(weights, dtype, layouts[name], format)
                attach_packed(module, layouts[name].weight_names, cpu)
            else:
                _fill(model, name, layouts[name], file, tensors, dtype)
    del reader  # its map of the file
    model.tie_weights()
    finish_loading(model)
    return model.eval()


def gguf_shape(tensor: gguf.ReaderTensor) -> tuple[int, ...]:
    """A tensor's shape in numpy's order (GGUF lists the fastest-moving dimension first)."""
    return tuple(int(n) for n in reversed(tensor.shape))


def _read(file, tensor: gguf.ReaderTensor, expert: int | None = None) -> np.ndarray:
    """A tensor's bytes (or one expert's, the `expert`-th slice along the first dimension) in memory of its own,
    (rows, bytes a row)."""
    rows = int(np.prod(gguf_shape(tensor)[:-1]))
    size, offset = int(tensor.n_bytes), int(tensor.data_offset)
    if expert is not None:
        experts = gguf_shape(tensor)[0]
        rows, size = rows // experts, size // experts
        offset += expert * size
    out = torch.empty((rows, size // rows), dtype=torch.uint8)
    read_into(file.fileno(), out, offset, Path(file.name))
    return out.numpy()


def _expert(file, tensors: dict[tuple[str, int], gguf.ReaderTensor], expert: int, format: str | None,
            dtype: torch.dtype) -> Expert:
    """One expert's (n·I, H) gate-up and (H, I) down weights in the engine's form."""
    def weight(key: tuple[str, int]) -> torch.Tensor | QuantizedWeight:
        tensor = tensors[key]
        raw = torch.from_numpy(_read(file, tensor, expert))
        return engine_weight(raw, tensor.tensor_type, gguf_shape(tensor)[-1], format, dtype)

    up = [weight(key) for key in sorted(key for key in tensors if key[0] == "gate_up_proj")]
    gate_up = stack_rows(up) if isinstance(up[0], QuantizedWeight) else torch.cat(up)
    return gate_up, weight(("down_proj", 0))


def _experts(file, tensors: dict[tuple[str, int], gguf.ReaderTensor], format: str | None,
             dtype: torch.dtype) -> Iterator[Expert]:
    for expert in range(gguf_shape(tensors[("down_proj", 0)])[0]):
        yield _expert(file, tensors, expert, format, dtype)


def _fill(model: PreTrainedModel, name: str, layout: ExpertsLayout, file,
          tensors: dict[tuple[str, int], gguf.ReaderTensor], dtype: torch.dtype) -> None:
    """The experts module's float parameters, (E, n·I, H) and (E, H, I), filled one expert at a time."""
    module = model.get_submodule(name)
    up_name, down_name = layout.weight_names
    gate_up = torch.empty(getattr(module, up_name).shape, dtype=dtype)
    down = torch.empty(getattr(module, down_name).shape, dtype=dtype)
    for expert in range(gate_up.shape[0]):
        gate_up[expert], down[expert] = _expert(file, tensors, expert, None, dtype)
    put_tensor(model, f"{name}.{up_name}", gate_up)
    put_tensor(model, f"{name}.{down_name}", down)
