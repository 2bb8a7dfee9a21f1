"""Peak memory of loading a model through the engine and processing one document, beside its weights' bytes.

A checkpoint of the geometry's family at its real sizes, cut to a few layers, is written in bf16 to a temporary
folder (random weights; the project's byte tokenizer, one token a byte). A child process imports torch,
transformers and the engine, notes its resident memory, loads the checkpoint through `Engine.load` in the
weights format asked for and processes a document of exactly the tokens asked for (prefill, and a summary of a
few tokens). The engine reads the checkpoint tensor by tensor, the experts straight into their packed form
(engine/loading/stream_load.py; `streamed` says it did). It reports its peak resident memory (the kernel's high-water
mark) minus what it held before loading, so the interpreter and the libraries are not counted, beside the bytes
the weights take in that format (engine/loading/model_size.py, from the checkpoint's headers).

With GGUF types, the same checkpoint is also written as a GGUF file in each (engine/synthetic/gguf_writer.py, with the
gguf package: every 2-D weight in that type) and loaded in the engine's format the type maps to without widening
(Q8_0: int8, Q4_0 and Q4_1: int4; F16: bf16). A model the person has, a folder or a GGUF file, is measured as it is.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from npumoe.engine.vocabulary import BF16, CHUNK_TOKENS

GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1", "F16")  # the types the gguf package writes
TARGET_RATIO = 1.15  # issue #15: peak RSS of load + one 2,048-token document at most 1.15 x the weights' bytes
_SUMMARY_TOKENS = 4
_SENTENCE = "The harbour master logs every ship that enters, the cargo it carries and the berth it takes. "


@dataclass(frozen=True)
class MemorySettings:
    layers: int = 2
    document_tokens: int = 2048
    chunk_tokens: int = CHUNK_TOKENS
    threads: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.layers, self.document_tokens, self.chunk_tokens, self.threads) < 1:
            raise ValueError(f"every size and count must be positive, got {self}")


def write_checkpoint(geometry_name: str, layers: int, folder: Path, seed: int = 0) -> Path:
    """A bf16 checkpoint of `geometry_name`'s family at its real sizes with its first `layers` layers, random
    weights, written to `folder` with the byte tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from npumoe.engine.synthetic.byte_tokenizer import build_byte_tokenizer
    from npumoe.engine.synthetic.geometry import GEOMETRIES, family_config

    if geometry_name not in GEOMETRIES:
        raise ValueError(f"unknown geometry {geometry_name!r}; choose one of {', '.join(sorted(GEOMETRIES))}")
    tokenizer = build_byte_tokenizer()
    config = family_config(GEOMETRIES[geometry_name], layers=layers, tie_word_embeddings=False,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                           bos_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # initialised in bf16: no fp32 copy
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def measure(folder: Path, weights: str, settings: MemorySettings) -> dict:
    """Load `folder` through the engine in `weights` in a child process, process one document, and return what
    the child measured with the weights' bytes in that format beside it."""
    from npumoe.engine.loading.model_size import checkpoint_tensors, model_size
    from npumoe.engine.vocabulary import WEIGHTS_DTYPE

    if weights not in WEIGHTS_DTYPE:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS_DTYPE)}, got {weights!r}")
    done = subprocess.run([sys.executable, "-m", __name__, str(folder), weights, json.dumps(settings.__dict__)],
                          capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if done.returncode != 0:
        raise RuntimeError(f"the measuring process failed ({done.returncode}):\n{done.stderr[-3000:]}")
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    size = model_size(checkpoint_tensors(folder)).formats[weights]
    peak = measured["peak_rss"] - measured["before_rss"]
    return {**measured, "weights": weights, "expert_bytes": size.expert_bytes, "other_bytes": size.other_bytes,
            "weight_bytes": size.total_bytes, "peak_over_before": peak, "ratio": peak / size.total_bytes,
            "target_ratio": TARGET_RATIO}


def run_memory_bench(geometry_name: str, weights: list[str], settings: MemorySettings,
                     gguf_types: Sequence[str] = ()) -> list[dict]:
    """One row per weights format, all on one checkpoint written once to a temporary folder, then one per GGUF
    type, the checkpoint written as a GGUF file in it."""
    unknown = sorted(set(gguf_types) - set(GGUF_TYPES))
    if unknown:
        raise ValueError(f"GGUF types must be among {', '.join(GGUF_TYPES)}, got {', '.join(unknown)}")
    with tempfile.TemporaryDirectory(prefix="npumoe-memory-") as temporary:
        folder = write_checkpoint(geometry_name, settings.layers, Path(temporary) / "model", settings.seed)
        about = {"geometry": geometry_name, "layers": settings.layers}
        rows = [{**about, "stored": "bf16 safetensors", **measure(folder, w, settings)} for w in weights]
        for name in gguf_types:
            file = write_gguf_file(folder, name, Path(temporary) / f"model-{name}.gguf")
            rows.append({**about, "stored": f"{name} GGUF", **measure(file, gguf_weights(name), settings)})
            file.unlink()  # a real geometry's file is gigabytes
        return rows


def run_model_memory_bench(model: Path, weights: list[str], settings: MemorySettings) -> list[dict]:
    """One row per weights format for a model the person has: a checkpoint folder or a GGUF file."""
    if not model.exists():
        raise ValueError(f"{model}: no such checkpoint folder or GGUF file")
    return [{"model": str(model), "stored": "GGUF" if model.is_file() else "safetensors",
             **measure(model, w, settings)} for w in weights]


def write_gguf_file(folder: Path, type_name: str, out: Path) -> Path:
    """The checkpoint in `folder` as a GGUF file `out`, every 2-D weight in `type_name`."""
    import gguf

    from npumoe.engine.synthetic.gguf_writer import write_gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    return write_gguf(folder, out, experts=qtype, weights=qtype)


def gguf_weights(type_name: str) -> str:
    """The engine's format a GGUF type's experts load into without widening (as `weights = "auto"` chooses)."""
    import gguf

    from npumoe.engine.formats.gguf_blocks import stored_format

    return stored_format(gguf.GGMLQuantizationType[type_name]) or BF16


def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def peak_rss() -> int:
    """This process's high-water resident memory, in bytes. On Linux, VmHWM: it starts afresh with the new program,
    whereas ru_maxrss keeps across exec the peak of the process that started this one (the bench, which wrote the
    checkpoint). Elsewhere ru_maxrss (macOS counts bytes)."""
    status = Path("/proc/self/status")
    if status.is_file():
        return next(int(line.split()[1]) * 1024 for line in status.read_text().splitlines()
                    if line.startswith("VmHWM:"))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _child(folder: str, weights: str, settings: MemorySettings) -> dict:
    """What the measuring process does: everything imported first, then load and one document."""
    import torch

    from npumoe.engine import Engine, EngineSettings

    torch.set_num_threads(settings.threads)
    before = rss()
    engine = Engine.load(EngineSettings(model=folder, weights=weights, chunk_tokens=settings.chunk_tokens,
                                        summary_tokens=_SUMMARY_TOKENS))
    loaded, load_peak = rss(), peak_rss()
    tokenizer = engine.loaded.tokenizer
    ids = tokenizer(_SENTENCE * (settings.document_tokens // len(_SENTENCE) + 1), add_special_tokens=False)
    text = tokenizer.decode(ids["input_ids"][:settings.document_tokens])
    result = engine.process(text)
    return {"before_rss": before, "loaded_rss": loaded, "load_peak_rss": load_peak, "processed_rss": rss(),
            "peak_rss": peak_rss(), "tokens": result.stats.tokens, "kernel": engine.runtime.layers[0].experts.kernel,
            "streamed": engine.loaded.streamed}


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1], sys.argv[2], MemorySettings(**json.loads(sys.argv[3])))))
