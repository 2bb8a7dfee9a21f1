"""`npumoed model quantize` for a GGUF file: its routed experts in the engine's format, written once into the home.

A Q8_0, Q4_0, Q4_1 or Q4_K file's experts map into int8 or int4 as they are read, so the store saves little for
them; for the other block types (Q5_x, Q5_K, Q6_K, Q2_K, Q3_K, the IQ types) and float files, each load would
otherwise dequantize and quantize every expert again (the load's log says what that cost).
The store holds one (N, K) weight per expert and projection, named `<GGUF tensor>.<expert>`
(gguf_load.stored_expert), in quant_store's layout and manifest; the other tensors stay in the file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from ..formats.gguf_blocks import engine_weight
from ..formats.quantize import INT4_GROUP, QuantizedWeight, check_format
from .gguf_header import read_gguf
from .gguf_load import EXPERTS_TENSOR, STORE_FILE, expert_bytes, gguf_shape, read_expert, stored_expert
from .quant_store import QuantizedStoreError, QuantizeReport, write_store


def quantize_gguf(source: Path, target: Path, format: str,
                  progress: Callable[[int, int], None] | None = None) -> QuantizeReport:
    """Write the GGUF file `source`'s routed experts in `format` into the folder `target`, one expert at a time."""
    check_format(format)
    tensors = read_gguf(source).tensors
    experts = [t for t in tensors if EXPERTS_TENSOR.fullmatch(t.name)]
    if not experts:
        raise QuantizedStoreError(f"{source}: no routed experts tensors (blk.<n>.ffn_gate_exps/up_exps/down_exps)")
    plan = {stored_expert(t.name, e): list(gguf_shape(t)[1:]) for t in experts for e in range(gguf_shape(t)[0])}

    def quantized(_: str) -> Iterator[tuple[QuantizedWeight, int]]:
        with source.open("rb") as file:
            for tensor in experts:
                for expert in range(gguf_shape(tensor)[0]):
                    raw = torch.from_numpy(read_expert(file, tensor, expert))
                    yield engine_weight(raw, tensor.tensor_type, gguf_shape(tensor)[-1], format,
                                        torch.float32), expert_bytes(tensor)

    return write_store(source, target, format, {STORE_FILE: plan}, quantized, kept=len(tensors) - len(experts),
                       group=INT4_GROUP, progress=progress)
