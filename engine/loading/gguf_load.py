"""Loading a GGUF file (llama.cpp's, Ollama's, LM Studio's) tensor by tensor, the routed experts expert by expert.

transformers' `from_pretrained(gguf_file=…)` dequantizes every tensor of the file to float32 before it builds the
model: about 122 GB for Qwen3-30B-A3B in Q4_K_M, an 18 GB file. Here instead:

- the config and the tokenizer come from the file's metadata through transformers' own GGUF mappings (with the
  expert width its qwen3moe and qwen2moe mappings do not read, taken from the file);
- the model is built on the meta device, and each GGUF name mapped to the model's parameter by transformers' own
  map (`get_gguf_hf_weights_map`, with its architecture's tensor processor for llama's permuted query and key);
- every tensor is read into memory of its own (`os.preadv`: the gguf package's reader maps the file, which is
  used for its header only); a weight other than the routed experts is converted to float one at a time, a few
  thousand rows at a time (a float32 copy of a whole embedding would take twice its place in bf16);
- each routed expert's gate, up and down projections are read from the stacked `ffn_*_exps` tensors and put in
  the engine's form one expert at a time (gguf_blocks.py: Q8_0, Q4_0 and Q4_1 straight into int8 or int4,
  other types dequantized and quantized again; taken from `npumoed model quantize`'s store where it holds
  them), then packed into the engine's CPU experts with `pack`, or
  written into the module's float parameters without it.

Architectures: the dense llama (Mistral's too, which llama.cpp writes as llama and transformers reads as one),
qwen2, qwen3 and gemma3 (its text model), whose FFNs are read as any other weight; Mixtral's experts in a llama file
(llama.cpp writes Mixtral as llama with `llama.expert_count`), qwen3moe and qwen2moe (its shared expert beside the
routed ones); any other is refused before anything is read, gpt-oss with the reason (`_UNREAD`).

A file this loader cannot read (experts in a layout it does not map, tensors the model has no place for)
raises stream_load.NotStreamable before the experts are read.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, MixtralConfig, PretrainedConfig, PreTrainedModel
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

from ..errors import ModelError
from ..formats.gguf_blocks import (
    CONVERSIONS,
    SECONDS,
    conversions_since,
    dequantized,
    engine_weight,
    file_type_format,
    stored_format,
)
from ..formats.quantize import QuantizedWeight, stack_rows
from ..moe.cpu_experts import CpuExperts, Expert
from ..moe.experts_layout import ExpertsLayout, is_experts_module, read_layout
from .gguf_header import forget_readers, read_gguf
from .quant_store import QuantizedReader, StoreWriter
from .resolve import GGUF_SUFFIX
from .stream_load import NotStreamable, attach_packed, finish_loading, put_tensor
from .tensor_reader import read_into

log = logging.getLogger(__name__)

# transformers' model types and the GGUF architecture names llama.cpp writes for them
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                      "gemma3_text": "gemma3", "mixtral": "llama", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe"}
READ_ARCHITECTURES = sorted(set(GGUF_ARCHITECTURES.values()))  # each name once, for messages
EXPERTS_TENSOR = re.compile(r"blk\.(?P<block>\d+)\.ffn_(?P<part>gate|up|down)_exps\.weight")
_LAYER = re.compile(r"layers\.(\d+)\.")
_UNREAD = {"gpt-oss": "transformers cannot read llama.cpp's gpt-oss files (its gpt-oss tensor processor is registered "
                      "as 'gpt_oss' but looked up by the file's 'gpt-oss', and its name map leaves the fused gate-up "
                      "experts and the experts' biases unmapped), so no load here could be checked against it"}
GGUF_MAGIC = b"GGUF"
_PARTS = {"gate": ("gate_up_proj", 0), "up": ("gate_up_proj", 1), "down": ("down_proj", 0)}
_FLOAT_VALUES_AT_ONCE = 1 << 22  # values of a float weight dequantized at once (16 MiB of float32)
STORE_FILE = "experts.safetensors"  # the one file of a GGUF file's quantized store


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
    """The model's config from the file's metadata, as transformers reads it, with what its mappings miss: the
    widths of qwen3moe's and qwen2moe's experts and of qwen2moe's shared expert, qwen3's head width, and the
    experts of a llama file that has them (llama.cpp writes Mixtral as llama with `llama.expert_count`), which make
    it a Mixtral."""
    reader = read_gguf(path)
    arch = reader.fields["general.architecture"].contents()
    if arch not in GGUF_ARCHITECTURES.values():
        why = _UNREAD.get(arch, "transformers' GGUF mapping and this loader do not map it")
        raise ModelError(f"{path.name}: its architecture {arch!r} is not one the engine reads from a GGUF file "
                         f"({', '.join(READ_ARCHITECTURES)}): {why}")
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)

    def field(key: str) -> int | None:
        held = reader.fields.get(f"{arch}.{key}")
        return None if held is None else int(held.contents())

    if arch == "llama" and field("expert_count"):
        settings = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
        config = MixtralConfig(**settings, num_local_experts=field("expert_count"),
                               num_experts_per_tok=field("expert_used_count"))
    for key, attribute in (("attention.key_length", "head_dim"),  # qwen3's mapping leaves its default of 128
                           ("expert_feed_forward_length", "moe_intermediate_size"),
                           ("expert_shared_feed_forward_length", "shared_expert_intermediate_size")):
        if (width := field(key)) is not None and hasattr(config, attribute):
            setattr(config, attribute, width)
    return config


def experts_format(path: Path) -> str | None:
    """The engine's format the file's routed experts are stored in, or no wider than: that of the file's type
    (gguf_blocks.file_type_format: a Q4_K_M file is int4 although llama.cpp stores some of its experts in Q5_0 or
    Q6_K), else gguf_blocks.stored_format of the block type most of their weights are in; None for float experts
    or a file without any."""
    counts: dict[int, int] = defaultdict(int)
    reader = read_gguf(path)
    for tensor in reader.tensors:
        if EXPERTS_TENSOR.fullmatch(tensor.name):
            counts[int(tensor.tensor_type)] += int(tensor.n_elements)
    stored = stored_format(max(counts, key=counts.__getitem__)) if counts else None
    file_type = reader.fields.get("general.file_type")
    declared = None if file_type is None else file_type_format(int(file_type.contents()))
    return declared if stored is not None and declared is not None else stored


def gguf_model(path: Path, dtype: torch.dtype, *, experts_implementation: str, pack: bool = False,
               format: str | None = None, quantized: QuantizedReader | None = None,
               keep: Path | None = None) -> PreTrainedModel:
    """The model in the GGUF file `path`, its float weights in `dtype`. With `pack`, every experts module's
    weights go straight into the engine's CPU experts in `format` (None: float), from `quantized` (what `npumoed
    model quantize`, or a load with `keep`, wrote from this file) where it holds them; with `keep` (and a `format`),
    the experts converted are also written into the quantized store `keep`, kept once the load is complete, so that
    the next load converts nothing. experts_layout.LayoutError for experts the engine does not run."""
    config = gguf_config(path)
    reader = read_gguf(path)
    arch = reader.fields["general.architecture"].contents()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation=experts_implementation)
    # a dense model has no experts modules: its FFN is read as any other weight
    layouts = {name: read_layout(name, module) for name, module in model.named_modules() if is_experts_module(module)}
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    names = get_gguf_hf_weights_map(model, processor, model_type=arch)
    # the experts module of each block: transformers' map names the fused gate-up parameter for qwen's only
    blocks = {int(_LAYER.search(name)[1]): name for name in layouts}
    experts: dict[str, dict[tuple[str, int], gguf.ReaderTensor]] = defaultdict(dict)
    with path.open("rb") as file:
        for tensor in reader.tensors:
            if match := EXPERTS_TENSOR.fullmatch(tensor.name):
                module = blocks.get(int(match["block"]), "")
                if module not in layouts or layouts[module].transposed or layouts[module].interleaved \
                        or layouts[module].bias:
                    raise NotStreamable(f"its experts tensor {tensor.name} is not in a layout the loader maps")
                experts[module][_PARTS[match["part"]]] = tensor
                continue
            target = names.get(tensor.name)
            if target is None:
                continue  # a tensor the model has no place for: transformers drops it too
            put_tensor(model, target, _float(file, tensor, processor, dtype))
        # the parsed header (half a GB for a 152k-token vocabulary) is not read again: it goes before the experts
        del reader
        forget_readers()
        counts, seconds = CONVERSIONS.copy(), SECONDS.copy()
        keeping = pack and format is not None and keep is not None and bool(experts)
        # the converted experts are kept only once the whole load is done: a failed load leaves no partial store
        with StoreWriter(path, keep, format, {STORE_FILE: kept_plan(experts)}) if keeping else nullcontext() \
                as store:
            for name, tensors in experts.items():
                module = model.get_submodule(name)
                if pack:
                    weights = _experts(file, tensors, format, dtype, quantized, store)
                    cpu = CpuExperts.streamed(weights, dtype, layouts[name], format)
                    attach_packed(module, layouts[name].weight_names, cpu)
                else:
                    _fill(model, name, layouts[name], file, tensors, dtype)
            if store is not None:
                store.commit()
    if pack and format is not None and (cost := conversions_since(counts, seconds)):
        kept = f"kept converted in {keep}: the next load converts nothing" if store and not store.abandoned else \
            f"`npumoed model quantize {path} --weights {format}` keeps them converted"
        # what each load costs until the experts are kept converted (then a load converts nothing)
        log.info("%s: experts converted into %s as they were read: %s (%s)", path.name, format, cost, kept)
    model.tie_weights()
    finish_loading(model)
    return model.eval()


def gguf_shape(tensor: gguf.ReaderTensor) -> tuple[int, ...]:
    """A tensor's shape in numpy's order (GGUF lists the fastest-moving dimension first)."""
    return tuple(int(n) for n in reversed(tensor.shape))


def stored_expert(tensor: str, expert: int) -> str:
    """The name `npumoed model quantize` stores expert `expert` of the stacked experts tensor `tensor` under."""
    return f"{tensor}.{expert}"


def kept_plan(experts: dict[str, dict[tuple[str, int], gguf.ReaderTensor]]) -> dict[str, list[int]]:
    """Each expert weight of these experts modules' tensors by its stored name, with its (N, K) shape, in the order
    a load converts them (module by module, expert by expert, `_parts`' order)."""
    return {stored_expert(tensors[key].name, expert): list(gguf_shape(tensors[key])[1:])
            for tensors in experts.values() for expert in range(gguf_shape(tensors[("down_proj", 0)])[0])
            for key in _parts(tensors)}


def _parts(tensors: dict[tuple[str, int], gguf.ReaderTensor]) -> list[tuple[str, int]]:
    """An expert's weights in the order they are read: the gate-up's parts (gate first), then the down's."""
    return [*sorted(key for key in tensors if key[0] == "gate_up_proj"), ("down_proj", 0)]


def _rows(tensor: gguf.ReaderTensor) -> int:
    return int(np.prod(gguf_shape(tensor)[:-1]))


def _read(file, tensor: gguf.ReaderTensor, first: int = 0, count: int | None = None) -> np.ndarray:
    """A tensor's bytes (or those of its `count` rows from row `first`) in memory of its own, (rows, bytes a
    row)."""
    rows = _rows(tensor)
    row_bytes = int(tensor.n_bytes) // rows
    count = rows - first if count is None else count
    out = torch.empty((count, row_bytes), dtype=torch.uint8)
    read_into(file.fileno(), out, int(tensor.data_offset) + first * row_bytes, Path(file.name))
    return out.numpy()


def read_expert(file, tensor: gguf.ReaderTensor, expert: int) -> np.ndarray:
    """The bytes of one expert's weight, the `expert`-th slice of a stacked (E, out, in) tensor."""
    per_expert = _rows(tensor) // gguf_shape(tensor)[0]
    return _read(file, tensor, expert * per_expert, per_expert)


def expert_bytes(tensor: gguf.ReaderTensor) -> int:
    """The bytes one expert's weight takes in a stacked experts tensor."""
    return int(tensor.n_bytes) // gguf_shape(tensor)[0]


def _float(file, tensor: gguf.ReaderTensor, processor: TensorProcessor, dtype: torch.dtype) -> torch.Tensor:
    """A weight other than the routed experts in `dtype`, dequantized a few thousand rows at a time, then laid out
    by the architecture's tensor processor."""
    shape = gguf_shape(tensor)
    out = torch.empty(shape, dtype=dtype)
    rows, width = out.view(-1, shape[-1]), shape[-1]
    step = max(1, _FLOAT_VALUES_AT_ONCE // width)
    for first in range(0, len(rows), step):
        raw = _read(file, tensor, first, min(step, len(rows) - first))
        rows[first:first + len(raw)] = torch.from_numpy(dequantized(raw, tensor.tensor_type)).view(len(raw), width)
    if len(shape) == 1:  # a norm or a bias, small: processed on float32 values (gemma's norms are stored as 1 + w)
        values = processor.process(weights=out.float().numpy(), name=tensor.name).weights
        return torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
    # on 2-D weights the processors of the architectures read here only rearrange values (llama's query and key
    # rows), so they run on the bits, which numpy holds in every dtype (it has no bfloat16)
    bits = out.view({2: torch.int16, 4: torch.int32}[dtype.itemsize]).numpy()
    arranged = processor.process(weights=bits, name=tensor.name).weights
    return torch.from_numpy(np.ascontiguousarray(arranged)).view(dtype)


def _expert(file, tensors: dict[tuple[str, int], gguf.ReaderTensor], expert: int, format: str | None,
            dtype: torch.dtype, quantized: QuantizedReader | None = None, store: StoreWriter | None = None) -> Expert:
    """One expert's (n·I, H) gate-up and (H, I) down weights in the engine's form, each converted one also
    written into `store`."""
    def weight(key: tuple[str, int]) -> torch.Tensor | QuantizedWeight:
        tensor = tensors[key]
        name = stored_expert(tensor.name, expert)
        if quantized is not None and name in quantized:
            return quantized.weight(name)
        raw = torch.from_numpy(read_expert(file, tensor, expert))
        converted = engine_weight(raw, tensor.tensor_type, gguf_shape(tensor)[-1], format, dtype)
        if store is not None:
            _keep(store, name, converted)
        return converted

    *up, down = (weight(key) for key in _parts(tensors))
    gate_up = stack_rows(up) if isinstance(up[0], QuantizedWeight) else torch.cat(up)
    return gate_up, down


def _keep(store: StoreWriter, name: str, weight: QuantizedWeight) -> None:
    """Write a converted weight into the store a load keeps; where the disk refuses it (full, read-only), the load
    goes on and keeps nothing, said in the log."""
    try:
        store.write(STORE_FILE, name, weight)
    except OSError as e:
        log.warning("%s: the converted experts are not kept (%s); the next load converts them again", store.target, e)
        store.abandon()


def _experts(file, tensors: dict[tuple[str, int], gguf.ReaderTensor], format: str | None,
             dtype: torch.dtype, quantized: QuantizedReader | None,
             store: StoreWriter | None = None) -> Iterator[Expert]:
    for expert in range(gguf_shape(tensors[("down_proj", 0)])[0]):
        yield _expert(file, tensors, expert, format, dtype, quantized, store)


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
