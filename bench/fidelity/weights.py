"""What the weights' format costs in accuracy: bf16, int8 and int4 against the fp32 model, and one real-size layer.

Whole model: a tiny skewed model of a family is prefilled over held-out text in fp32 (the reference), in bf16,
and in bf16 with its experts quantized to int8 and int4 as the engine runs them (`weights = "int8"`: the experts
quantized, the rest bf16). Each is compared with fp32 and with bf16 (the float model whose non-expert part it
shares): top-1 agreement and mean KL of the next-token distributions.

A random tiny model's next-token distribution is nearly flat: its top two logits sit so close that bf16's
rounding alone changes the top-1 at a few percent of positions, so top-1 agreement there cannot tell 99 % from
97 %. A trained model is confident where the text is predictable. Training one here is too slow for a benchmark
that runs on a laptop, so `readout` fits only the output layer: the random body's final hidden states on
calibration text, read out by a ridge regression onto the next token (as in reservoir computing) with the
temperature that minimises cross-entropy. The body, experts included, stays random; the readout makes the
top-1 mean something (it predicts real text), and its margins are what decide agreement.

One layer: the routed experts of one layer at a real model's sizes, random weights, fp32 reference, the experts
quantized by the engine; relative L2 error of the layer's output. Beside it, the format's own floor: the same layer
with its weights rounded to the format and everything else exact (fp32 activations, torch's experts), which no
kernel of that format can beat; what the engine adds above it is its rounding of the activations to int8.
Gaussian weights and activations are the baseline; `heavy` draws what trained LLMs are reported to have instead
(no real checkpoint can be read here): weights heavier-tailed than Gaussian (Student t, 6 degrees of freedom)
with per-row scales that vary (log-normal), and a few activation channels far larger than the rest (outlier
features); `heavy-weights` has the weights alone, so the two causes can be told apart.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from npumoe.engine.attach.runtime import MoeRuntime
from npumoe.engine.backends.registry import get_backend
from npumoe.engine.formats.quantize import quantize
from npumoe.engine.generate.prefill import new_cache, prefill, windows
from npumoe.engine.loading.load import LoadedModel
from npumoe.engine.synthetic.geometry import Geometry, build_layer_model, draw_routing, layer_experts, routing_prior
from npumoe.engine.vocabulary import BF16, CHUNK_TOKENS, CPU, FP32, INT4, INT8, QUANTIZED

from ..paths import relative_error
from .capacity import agreement

FORMATS = (FP32, BF16, INT8, INT4)
FLOAT_OF = {FP32: FP32, BF16: BF16, INT8: BF16, INT4: BF16}  # the float model each format's non-expert part is

# The readout's ridge penalty, relative to the mean squared feature (keeps the fit well posed on short texts).
RIDGE = 1e-2

# Tokens the readout is fitted on: many times its inputs (the hidden size), few enough to fit in seconds.
READOUT_TOKENS = 8192

# The heavy-tailed draw: Student t degrees of freedom (kurtosis 6, twice a Gaussian's), the spread of the
# per-row log-scales, and the share and size of the outlier activation channels.
T_DOF = 6
ROW_LOG_SCALE = 0.3
OUTLIER_SHARE, OUTLIER_SCALE = 0.005, 20.0
# Each draw: (heavy-tailed weights, outlier activation channels). heavy-weights and heavy tell the two apart.
DISTRIBUTIONS = {"gaussian": (False, False), "heavy-weights": (True, False), "heavy": (True, True)}
TARGETS = {INT8: 0.01, INT4: 0.05}  # issue #15's bound on a real-size layer's relative error


@dataclass(frozen=True)
class WeightsFidelitySettings:
    chunk_tokens: int = 128
    eval_tokens: int = 4096  # at most this many held-out tokens
    formats: tuple[str, ...] = FORMATS

    def __post_init__(self) -> None:
        if min(self.chunk_tokens, self.eval_tokens) < 1 or not set(self.formats) <= set(FORMATS):
            raise ValueError(f"need positive sizes and formats among {', '.join(FORMATS)}, got {self}")


def fit_readout(loaded: LoadedModel, texts: Sequence[str], chunk_tokens: int, *,
                max_tokens: int = READOUT_TOKENS) -> float:
    """Replace the model's output layer with a ridge-regression readout of the next token from its final hidden
    states on `texts` (their first `max_tokens` tokens), at the temperature that minimises cross-entropy there;
    returns that cross-entropy (nats)."""
    model, tokenizer = loaded.model, loaded.tokenizer
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{loaded.name}: an output layer with a bias is not refitted")
    features, targets = [], []
    with torch.inference_mode():
        for text in texts:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens - sum(map(len, targets))]
            if len(ids) < 2:
                break
            for piece in windows(ids, loaded.context_tokens // chunk_tokens * chunk_tokens):
                hidden = torch.cat(list(prefill(model, piece, chunk_tokens, new_cache(model))))
                features.append(hidden[:-1].double())
                targets.append(torch.tensor(piece[1:]))
    h, y = torch.cat(features), torch.cat(targets)
    if len(y) < h.shape[1]:
        raise ValueError(f"the readout needs at least {h.shape[1]} tokens of text, got {len(y)}")
    gram = h.T @ h
    gram += RIDGE * gram.diagonal().mean() * torch.eye(len(gram), dtype=gram.dtype)
    onehot = F.one_hot(y, head.weight.shape[0]).double()
    weight = torch.linalg.solve(gram, h.T @ onehot).T  # (V, H)
    logits = h @ weight.T
    scales = torch.logspace(-1, 3, 81, dtype=torch.float64)
    losses = torch.stack([F.cross_entropy(scale * logits, y) for scale in scales])
    best = int(losses.argmin())
    with torch.no_grad():
        head.weight.copy_((scales[best] * weight).to(head.weight.dtype))
    return float(losses[best])


def run_weights_fidelity(loaded: LoadedModel, eval_text: str, settings: WeightsFidelitySettings) -> list[dict]:
    """One row per format: top-1 agreement and mean KL against the fp32 model and against the float model of
    the same non-expert dtype. `loaded` must hold the model in fp32."""
    model, tokenizer = loaded.model, loaded.tokenizer
    if model.dtype != torch.float32:
        raise ValueError(f"the reference must be the fp32 model, got {model.dtype}")
    ids = tokenizer(eval_text, add_special_tokens=False)["input_ids"][:settings.eval_tokens]
    if len(ids) < 2:
        raise ValueError("the held-out text needs at least two tokens")
    window = loaded.context_tokens // settings.chunk_tokens * settings.chunk_tokens

    def logits(of: PreTrainedModel) -> torch.Tensor:
        return torch.cat([chunk.float() for piece in windows(ids, window)
                          for chunk in prefill(of, piece, settings.chunk_tokens, new_cache(of), logits=True)])

    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    rows = []
    with torch.inference_mode():
        floats = {FP32: logits(model), BF16: logits(bf16)}
        for format in settings.formats:
            if format in QUANTIZED:
                runtime = MoeRuntime(bf16, get_backend(CPU), quantized=format)
                try:
                    got = logits(bf16)
                    ran = runtime.stats.assignments
                finally:
                    runtime.detach()
                if ran == 0:
                    raise RuntimeError(f"the {format} experts did not run")
            else:
                got = floats[format]
            versus_fp32, versus_float = agreement(got, floats[FP32]), agreement(got, floats[FLOAT_OF[format]])
            rows.append({"format": format, "eval_tokens": len(ids),
                         "top1_vs_fp32": versus_fp32["top1_agreement"], "kl_vs_fp32": versus_fp32["mean_kl"],
                         "top1_vs_float": versus_float["top1_agreement"], "kl_vs_float": versus_float["mean_kl"],
                         "vs_float": FLOAT_OF[format]})
    return rows


def layer_errors(geometry: Geometry, formats: Sequence[str], distribution: str, *, tokens: int = CHUNK_TOKENS,
                 seed: int = 0, on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """Relative L2 error of one MoE layer's output with its experts in each quantized format, against the same
    layer in fp32, on weights and activations drawn from `distribution` (one of DISTRIBUTIONS)."""
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {', '.join(DISTRIBUTIONS)}, got {distribution!r}")
    if not set(formats) <= set(QUANTIZED):
        raise ValueError(f"formats must be among {', '.join(QUANTIZED)}, got {list(formats)}")
    generator = torch.Generator().manual_seed(seed)
    model = build_layer_model(geometry, torch.float32, generator)
    experts = layer_experts(model)
    x = torch.randn(tokens, geometry.hidden, generator=generator)
    heavy_weights, outlier_channels = DISTRIBUTIONS[distribution]
    if heavy_weights:
        _heavy_weights(experts, geometry, generator)
    if outlier_channels:
        outliers = torch.randperm(geometry.hidden, generator=generator)[:max(1, round(OUTLIER_SHARE * geometry.hidden))]
        x[:, outliers] *= OUTLIER_SCALE
    index, weights = draw_routing(routing_prior(geometry, generator), tokens, geometry.top_k, generator)
    rows = []
    with torch.inference_mode():
        reference = experts(x, index, weights)
        for format in formats:
            runtime = MoeRuntime(model, get_backend(CPU), quantized=format)
            try:
                output = experts(x, index, weights)
                ran = runtime.stats.assignments
            finally:
                runtime.detach()
            del runtime
            gc.collect()  # the packed copy goes before the next format's
            if ran == 0:
                raise RuntimeError(f"the {format} experts did not run")
            rows.append({"geometry": geometry.name, "distribution": distribution, "format": format,
                         "tokens": tokens, "rel_error": relative_error(output, reference),
                         "weights_alone_error": relative_error(_with_rounded_weights(experts, format, x, index,
                                                                                     weights), reference)})
            if on_result is not None:
                on_result(rows[-1])
    return rows


@torch.no_grad()
def _with_rounded_weights(experts: torch.nn.Module, format: str, *inputs: torch.Tensor) -> torch.Tensor:
    """The experts' output on `inputs` with their weights rounded to `format` (and back to fp32), computed by the
    module itself; the weights are put back after."""
    weights = [p for p in experts.parameters() if p.ndim == 3]  # (E, N, K) gate-up and down projections
    originals = [w.clone() for w in weights]
    try:
        for weight in weights:
            for e in range(weight.shape[0]):
                weight[e] = quantize(weight[e], format).dequantize()
        return experts(*inputs)
    finally:
        for weight, original in zip(weights, originals, strict=True):
            weight.copy_(original)


@torch.no_grad()
def _heavy_weights(experts: torch.nn.Module, geometry: Geometry, generator: torch.Generator) -> None:
    """Redraw the experts' weights Student-t distributed with log-normal row scales, at the Gaussian draw's
    variance (t with d degrees of freedom has variance d / (d - 2)), one expert at a time."""
    unit = ((T_DOF - 2) / T_DOF) ** 0.5
    for weight, fan_in in ((experts.gate_up_proj, geometry.hidden), (experts.down_proj, geometry.ffn)):
        for e in range(geometry.experts):
            shape = weight.shape[1:]
            chi2 = torch.randn((T_DOF, *shape), generator=generator).square().sum(0)
            t = torch.randn(shape, generator=generator) / (chi2 / T_DOF).sqrt()
            rows = (ROW_LOG_SCALE * torch.randn(shape[0], 1, generator=generator)).exp()
            weight[e] = t * unit * rows / fan_in**0.5
