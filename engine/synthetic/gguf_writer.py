"""A Hugging Face checkpoint written as a GGUF file, the way llama.cpp's converter lays one out, for tests and benches.

The tensor names are gguf's own (the reverse of the map transformers reads GGUF files with); llama's query and key
rows are permuted as llama.cpp permutes them; routed experts are stored stacked, one (E, out, in) tensor per
projection (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`); the tokenizer and chat template go in the metadata
(a model with no tokenizer gets llama.cpp's "none" vocabulary: its vocab_size dummy tokens). Each 2-D weight is
stored in the type asked for, experts and other weights apart; one whose rows are not whole blocks of that type, and
every 1-D tensor, is stored as F16 or F32 instead, as llama.cpp does. Architectures: the dense llama, qwen2, qwen3,
gemma3 (its norms stored as 1 + w, as llama.cpp stores them) and Mistral (which llama.cpp writes as llama, and
transformers reads back as one); qwen3moe, qwen2moe (its shared expert and the shared expert's gate, a
1-D tensor as llama.cpp keeps it) and Mixtral, which llama.cpp writes as llama with `llama.expert_count`.

Tensors are converted and written one at a time, each quantized and written a few thousand rows at a time
(`write_streamed`), so a real-size model needs no second copy of its weights in memory (nor a float32 one of its
largest tensor). random_gguf.py writes a model at a real geometry through the same layout with random blocks.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

from ..loading.gguf_load import GGUF_ARCHITECTURES
from .k_quants import q4_k_blocks

F16, F32, Q4_K = gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q4_K
VALUES_AT_ONCE = 1 << 22  # values converted at once (16 MiB of float32)
_EXPERTS = re.compile(r"(?P<module>.*\.experts)\.(?P<name>gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class GgufTensor:
    """One GGUF tensor to write: its name, float shape, storage type, and how to get its float32 values."""
    name: str
    shape: tuple[int, ...]
    qtype: gguf.GGMLQuantizationType
    values: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(gguf.quant_shape_to_byte_shape(self.shape, self.qtype))


def write_gguf(folder: Path, out: Path, *, experts: gguf.GGMLQuantizationType = F16,
               weights: gguf.GGMLQuantizationType = F16, file_type: gguf.LlamaFileType | None = None) -> Path:
    """The checkpoint in `folder` (llama, mixtral, qwen2_moe or qwen3_moe) as the GGUF file `out`: routed experts
    in `experts`, the other 2-D weights in `weights`, `file_type` (what llama-quantize was asked for) recorded as
    `general.file_type` where given. The checkpoint is read in its own dtype (a bf16 one is not widened in
    memory)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
    return write_model_gguf(model, AutoTokenizer.from_pretrained(folder), out, experts=experts, weights=weights,
                            file_type=file_type)


def write_model_gguf(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, out: Path, *,
                     experts: gguf.GGMLQuantizationType = F16,
                     weights: gguf.GGMLQuantizationType = F16,
                     file_type: gguf.LlamaFileType | None = None) -> Path:
    """`model` in memory (llama, mixtral, qwen2_moe or qwen3_moe, any float dtype) as the GGUF file `out`, as
    write_gguf lays it out; `tokenizer` None: llama.cpp's "none" vocabulary of the config's vocab_size (a model fed
    token ids only)."""
    arch = GGUF_ARCHITECTURES[model.config.model_type]
    writer = model_writer(out, model.config, tokenizer)
    if file_type is not None:
        writer.add_file_type(file_type)
    tensors = list(gguf_tensors(model, arch, experts, weights))
    write_streamed(writer, tensors, lambda tensor: _quantized(tensor.values(), tensor.qtype))
    return out


def model_writer(out: Path, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase | None) -> gguf.GGUFWriter:
    """A writer for `out` holding the metadata of a model of `config` and its tokenizer (None: llama.cpp's "none"
    vocabulary of the config's vocab_size; a tokenizer with fewer tokens than that is padded with unused ones)."""
    arch = GGUF_ARCHITECTURES[config.model_type]
    writer = gguf.GGUFWriter(out, arch)
    _write_config(writer, config)
    if tokenizer is None:
        writer.add_tokenizer_model("none")
    else:
        _write_tokenizer(writer, tokenizer, config.vocab_size)
    return writer


def write_streamed(writer: gguf.GGUFWriter, tensors: Sequence[GgufTensor],
                   data: Callable[[GgufTensor], Iterator[np.ndarray]],
                   progress: Callable[[int], None] | None = None) -> None:
    """Every tensor's info, then its bytes as `data` yields them, a few rows at a time (the gguf package's
    write_tensor_data takes a whole tensor at once: a layer of experts would be in memory whole); `progress` is
    told the bytes of each part written. Closes the writer."""
    for tensor in tensors:  # the header lists every tensor's type and size before any data
        writer.add_tensor_info(tensor.name, gguf.quant_shape_to_byte_shape(tensor.shape, tensor.qtype), np.uint8,
                               tensor.nbytes, raw_dtype=tensor.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    out = writer.fout[0]
    for tensor in tensors:
        writer.write_padding(out, out.tell())  # each tensor starts at the file's alignment
        written = 0
        for part in data(tensor):
            part.tofile(out)
            written += part.nbytes
            if progress is not None:
                progress(part.nbytes)
        if written != tensor.nbytes:
            raise ValueError(f"{tensor.name}: {written} bytes written, its {tensor.qtype.name} shape takes "
                             f"{tensor.nbytes}")
    writer.close()


def gguf_tensors(model: PreTrainedModel, arch: str, experts: gguf.GGMLQuantizationType,
                 weights: gguf.GGMLQuantizationType) -> Iterator[GgufTensor]:
    """`model`'s tensors as the file lists them: gguf names, shapes, storage types (a model on the meta device
    gives every one but their values)."""
    config = model.config
    names = {hf: name for name, hf in get_gguf_hf_weights_map(
        model, TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict()), model_type=arch).items()}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if hf_name.endswith("shared_expert_gate.weight"):
            tensor = tensor[0]  # (1, H) in the model, (H,) in llama.cpp's files
        if match := _EXPERTS.fullmatch(hf_name):
            yield from _experts(match["module"], match["name"], tensor, experts)
            continue
        values = _float(tensor)
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in hf_name else config.num_key_value_heads
            values = _permuted(values, heads)
        if arch == "gemma3" and names[hf_name].endswith("norm.weight"):
            values = _plus_one(values)
        yield _stored(names[hf_name], tuple(tensor.shape), weights, values)


def _float(tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: tensor


def _permuted(values: Callable[[], torch.Tensor], heads: int) -> Callable[[], torch.Tensor]:
    return lambda: torch.from_numpy(_llama_permute(values().float().numpy(), heads))


def _plus_one(values: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    return lambda: values().float() + 1


def _quantized(tensor: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> Iterator[np.ndarray]:
    """The tensor's GGUF bytes, (rows, row bytes), quantized a few thousand rows at a time: a float32 copy of a
    real embedding or layer of experts (and the quantizer's temporaries) would be gigabytes."""
    rows = tensor.reshape(-1, tensor.shape[-1])
    step = max(1, VALUES_AT_ONCE // rows.shape[1])
    for i in range(0, len(rows), step):
        part = np.ascontiguousarray(rows[i:i + step].float().numpy())
        # the gguf package reads K-quants but writes none of them
        yield q4_k_blocks(part) if qtype == Q4_K else gguf.quants.quantize(part, qtype)


def _write_config(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    # gemma3 keeps one set per attention type: the file holds the global layers'
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(config.vocab_size)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if hasattr(config, "moe_intermediate_size"):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if hasattr(config, "shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)


def _write_tokenizer(writer: gguf.GGUFWriter, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
    """A byte-level BPE tokenizer as llama.cpp's "gpt2" tokenizer model: tokens by id, merges, special ids; padded
    with unused tokens up to the model's `vocab_size` (an embedding wider than the tokenizer, as real models have)."""
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    special = set(tokenizer.all_special_tokens) | set(tokenizer.added_tokens_encoder)
    types = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    padding = [f"<|unused_{i}|>" for i in range(vocab_size - len(tokens))]
    tokens += padding
    types += [gguf.TokenType.UNUSED] * len(padding)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))  # transformers reads them where a file has no merges
    writer.add_token_types(types)
    writer.add_token_merges(_merges(tokenizer))
    for token_id, add in ((tokenizer.bos_token_id, writer.add_bos_token_id),
                          (tokenizer.eos_token_id, writer.add_eos_token_id),
                          (tokenizer.pad_token_id, writer.add_pad_token_id)):
        if token_id is not None:
            add(token_id)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def _merges(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The tokenizer's BPE merges as llama.cpp stores them ("a b"), none for another kind. Read from its saved
    form: the `tokenizers` BPE object does not expose them, and llama.cpp refuses a "gpt2" vocabulary without."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = json.loads(backend.to_str())["model"] if backend is not None else {}
    return [" ".join(pair) if isinstance(pair, list) else pair for pair in model.get("merges", [])]


def _experts(module: str, name: str, tensor: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> Iterator[GgufTensor]:
    """A fused (E, 2I, H) gate-up or (E, H, I) down parameter as llama.cpp's stacked per-projection tensors."""
    layer = re.search(r"layers\.(\d+)\.", module).group(1)
    if name == "down_proj":
        yield _stored(f"blk.{layer}.ffn_down_exps.weight", tuple(tensor.shape), qtype, _float(tensor))
        return
    gate, up = tensor.chunk(2, dim=1)
    for part, half in (("gate", gate), ("up", up)):
        yield _stored(f"blk.{layer}.ffn_{part}_exps.weight", tuple(half.shape), qtype, _float(half))


def _stored(name: str, shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType,
            values: Callable[[], torch.Tensor]) -> GgufTensor:
    """The tensor in `qtype`, or F32 when 1-D, or F16 when its rows are not whole blocks of `qtype`."""
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    if len(shape) < 2:
        qtype = F32
    elif shape[-1] % block:
        qtype = F16
    return GgufTensor(name, shape, qtype, values)


def _llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permutation of query and key rows (convert_hf_to_gguf.py's LlamaModel.permute), which
    transformers undoes when it reads the file."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
