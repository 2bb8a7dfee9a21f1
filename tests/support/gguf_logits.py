"""Logits of a GGUF file read two ways: by transformers' own GGUF load (the reference) and by a model in hand."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from npumoe.engine.loading.gguf_load import gguf_config

IDS = torch.arange(3, 60)[None]


def reference_logits(file: Path) -> torch.Tensor:
    """transformers' own load of the file (every tensor dequantized to float32), with the config the engine reads
    (transformers' qwen3 mapping does not read the head width)."""
    model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32,
                                                 config=gguf_config(file)).eval()
    return logits(model)


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return model(IDS).logits
