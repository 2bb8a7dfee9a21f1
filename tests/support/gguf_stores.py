"""Tiny GGUF models, and the stores people keep such files in, laid out as Ollama, LM Studio and huggingface_hub
lay them out, under a fake home."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen3Config

from npumoe.engine.loading import model_stores
from npumoe.engine.synthetic.byte_tokenizer import build_byte_tokenizer
from npumoe.engine.synthetic.gguf_writer import write_gguf, write_model_gguf

Q8_0 = gguf.GGMLQuantizationType.Q8_0
OLLAMA_MODEL = model_stores.OLLAMA_MODEL_LAYER


def tiny_ggufs(tiny_moe: Path, folder: Path) -> dict[str, Path]:
    """A tiny qwen3moe GGUF (experts in Q8_0), and tiny dense llama (with the byte tokenizer), qwen3 and gemma3 ones
    (token ids only), written in `folder`."""
    tokenizer = build_byte_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    llama = folder / "llama"
    AutoModelForCausalLM.from_config(config).save_pretrained(llama)
    tokenizer.save_pretrained(llama)
    sizes = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)
    dense = {arch: AutoModelForCausalLM.from_config(config) for arch, config in (
        ("qwen3", Qwen3Config(**sizes)), ("gemma3", Gemma3TextConfig(**sizes, sliding_window=16)))}
    return {"qwen3moe": write_gguf(tiny_moe, folder / "tiny-moe.gguf", experts=Q8_0),
            "llama": write_gguf(llama, folder / "tiny-llama.gguf"),
            **{arch: write_model_gguf(model, None, folder / f"tiny-{arch}.gguf", weights=Q8_0)
               for arch, model in dense.items()}}


def fake_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home of no stores yet, where every store is looked for in its default place; Ollama's Linux service's
    store too (in this process)."""
    home = tmp_path / "person"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for variable in ("OLLAMA_MODELS", "HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(model_stores, "OLLAMA_SERVICE_MODELS", tmp_path / "usr-share-ollama" / "models")
    return home


def ollama_pull(root: Path, file: Path, *parts: str) -> Path:
    """`file` as Ollama keeps a pulled model: its blob, and a manifest under manifests/<parts> naming it between a
    template and a params layer. The blob's path."""
    data = file.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    blob = root / "blobs" / f"sha256-{digest}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    layer = {"mediaType": OLLAMA_MODEL, "digest": f"sha256:{digest}", "size": len(data)}
    others = [{"mediaType": f"application/vnd.ollama.image.{kind}", "digest": f"sha256:{kind:0>64}", "size": 1}
              for kind in ("template", "params")]
    ollama_manifest(root, {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                           "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                                      "digest": f"sha256:{'c' * 64}", "size": 2},
                           "layers": [others[0], layer, others[1]]}, *parts)
    return blob


def ollama_manifest(root: Path, manifest: object, *parts: str) -> Path:
    path = root / "manifests" / Path(*parts)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(manifest if isinstance(manifest, str) else json.dumps(manifest))
    return path


def hf_download(cache: Path, repo: str, file: Path, filename: str, revision: str = "a" * 40) -> Path:
    """`file` as huggingface_hub caches a download of `repo`'s `filename`: a blob, a snapshot link to it, refs/main.
    The snapshot's path."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    data = file.read_bytes()
    blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    link = folder / "snapshots" / revision / filename
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(blob, link.parent))
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / "main").write_text(revision)
    return link


def lmstudio_download(models: Path, relative: str, file: Path) -> Path:
    path = models / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(file, path)
    return path
