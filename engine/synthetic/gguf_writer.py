"""A Hugging Face checkpoint written as a GGUF file, the way llama.cpp's converter lays one out, for tests and benches.

The tensor names are gguf's own (the reverse of the map transformers reads GGUF files with); llama's query and key
rows are permuted as llama.cpp permutes them; routed experts are stored stacked, one (E, out, in) tensor per
projection (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`); the tokenizer and chat template go in the metadata.
Each 2-D weight is stored in the type asked for, experts and other weights apart; one whose rows are not whole
blocks of that type, and every 1-D tensor, is stored as F16 or F32 instead, as llama.cpp does. Architectures:
llama, qwen3moe, qwen2moe (its shared expert and the shared expert's gate, a 1-D tensor as llama.cpp keeps it)
and Mixtral, which llama.cpp writes as llama with `llama.expert_count`.

The checkpoint is read in its own dtype, each tensor quantized one expert at a time and spooled to a temporary file
until the header is written: a real-geometry checkpoint is written at about the memory of one copy of it.
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

from ..loading.gguf_load import GGUF_ARCHITECTURES

F16, F32 = gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32
_VALUES_AT_ONCE = 1 << 22
_EXPERTS = re.compile(r"(?P<module>.*\.experts)\.(?P<name>gate_up_proj|down_proj)$")


def write_gguf(folder: Path, out: Path, *, experts: gguf.GGMLQuantizationType = F16,
               weights: gguf.GGMLQuantizationType = F16) -> Path:
    """The checkpoint in `folder` (llama, mixtral, qwen2_moe or qwen3_moe) as the GGUF file `out`: routed experts
    in `experts`, the other 2-D weights in `weights`."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = model.config
    arch = GGUF_ARCHITECTURES[config.model_type]
    writer = gguf.GGUFWriter(out, arch, use_temp_file=True)
    _write_config(writer, arch, model)
    _write_tokenizer(writer, tokenizer)
    names = {hf: name for name, hf in get_gguf_hf_weights_map(
        model, TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict()), model_type=arch).items()}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if hf_name.endswith("shared_expert_gate.weight"):
            tensor = tensor[0]  # (1, H) in the model, (H,) in llama.cpp's files
        if match := _EXPERTS.fullmatch(hf_name):
            _write_experts(writer, match["module"], match["name"], tensor, experts)
            continue
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in hf_name else config.num_key_value_heads
            tensor = torch.from_numpy(_llama_permute(tensor.float().numpy(), heads))
        _add(writer, names[hf_name], tensor, weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _write_config(writer: gguf.GGUFWriter, arch: str, model: PreTrainedModel) -> None:
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
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


def _write_tokenizer(writer: gguf.GGUFWriter, tokenizer: PreTrainedTokenizerBase) -> None:
    """A byte-level BPE tokenizer as llama.cpp's "gpt2" tokenizer model: tokens by id, merges, special ids."""
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    special = set(tokenizer.all_special_tokens) | set(tokenizer.added_tokens_encoder)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))  # transformers reads them where a file has no merges
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    model = tokenizer.backend_tokenizer.model
    merges = [" ".join(pair) if isinstance(pair, tuple) else pair for pair in getattr(model, "merges", None) or []]
    writer.add_token_merges(merges)
    for token_id, add in ((tokenizer.bos_token_id, writer.add_bos_token_id),
                          (tokenizer.eos_token_id, writer.add_eos_token_id),
                          (tokenizer.pad_token_id, writer.add_pad_token_id)):
        if token_id is not None:
            add(token_id)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def _write_experts(writer: gguf.GGUFWriter, module: str, name: str, tensor: torch.Tensor,
                   qtype: gguf.GGMLQuantizationType) -> None:
    """A fused (E, 2I, H) gate-up or (E, H, I) down parameter as llama.cpp's stacked per-projection tensors."""
    layer = re.search(r"layers\.(\d+)\.", module).group(1)
    if name == "down_proj":
        _add(writer, f"blk.{layer}.ffn_down_exps.weight", tensor, qtype)
        return
    gate, up = tensor.chunk(2, dim=1)
    _add(writer, f"blk.{layer}.ffn_gate_exps.weight", gate, qtype)
    _add(writer, f"blk.{layer}.ffn_up_exps.weight", up, qtype)


def _add(writer: gguf.GGUFWriter, name: str, tensor: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> None:
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    if tensor.ndim < 2:
        qtype = F32
    elif tensor.shape[-1] % block:
        qtype = F16
    writer.add_tensor(name, _quantized(tensor, qtype), raw_dtype=qtype)


def _quantized(tensor: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """The tensor's GGUF bytes, (…, row bytes), quantized a few thousand rows at a time: a float32 copy of a real
    embedding or layer of experts (and the quantizer's temporaries) would be gigabytes."""
    rows = tensor.reshape(-1, tensor.shape[-1])
    step = max(1, _VALUES_AT_ONCE // rows.shape[1])
    parts = [gguf.quants.quantize(np.ascontiguousarray(rows[i:i + step].float().numpy()), qtype)
             for i in range(0, len(rows), step)]
    return np.concatenate(parts).reshape(*tensor.shape[:-1], -1)


def _llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permutation of query and key rows (convert_hf_to_gguf.py's LlamaModel.permute), which
    transformers undoes when it reads the file."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
