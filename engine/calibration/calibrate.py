"""Calibration: run text through the model in prefill chunks and measure each expert's load.

The load of an expert in one chunk is the number of the chunk's tokens routed to it. Texts are
joined (end-of-text between them) into one token stream, prefilled in windows that fit the
model's context, and only full chunks are counted (a short last chunk would understate every load),
unless the data holds no full chunk at all. Every chunk also shows each expert's largest values
(its input, inner projections and output), so a backend that computes in fp16 knows which experts
would overflow it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..attach.runtime import MoeRuntime, released_format
from ..backends.registry import get_backend
from ..generate.prefill import new_cache, prefill, windows
from ..loading.load import LoadedModel
from ..moe.cpu_experts import CpuExperts
from ..moe.model_experts import moe_layouts
from ..plan.expert_plan import ExpertLoad, ExpertMagnitudes
from ..vocabulary import CHUNK_TOKENS, CPU


@dataclass(frozen=True)
class Calibration:
    chunk_tokens: int
    tokens: int
    chunks: int  # chunks whose loads were counted
    sources: tuple[str, ...]
    layers: tuple[tuple[str, ExpertLoad], ...]  # (experts module name, its load) per MoE layer
    magnitudes: tuple[tuple[str, ExpertMagnitudes], ...] = ()  # (experts module name, its largest values)


def calibrate(loaded: LoadedModel, texts: Sequence[tuple[str, str]], *, chunk_tokens: int = CHUNK_TOKENS,
              on_chunk: Callable[[int, int], None] | None = None) -> Calibration:
    """Measure expert loads on `texts`, given as (source name, text); `on_chunk(done, total)` per chunk."""
    moe_layouts(loaded.model)  # a dense model has no experts to measure: ModelError saying so
    if chunk_tokens > loaded.context_tokens:
        raise ValueError(f"chunk length {chunk_tokens} exceeds the model's context ({loaded.context_tokens})")
    if not any(text.strip() for _, text in texts):
        raise ValueError("calibration data holds no text")
    tokenizer = loaded.tokenizer
    end = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    stream: list[int] = []
    for _, text in texts:
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + end

    window = loaded.context_tokens // chunk_tokens * chunk_tokens  # whole chunks that fit the context
    pieces = windows(stream, window)
    chunk_lengths = [len(chunk) for piece in pieces for chunk in windows(piece, chunk_tokens)]
    # experts loaded packed are measured in the format they were packed in, the one they run in; the dense
    # projections stay the model's own, so measuring makes no second copy of them (a full-size model has no room)
    runtime = MoeRuntime(loaded.model, get_backend(CPU), quantized=released_format(loaded.model), projections=False)
    peaks = [PeakRecorder(layer.experts) for layer in runtime.layers]
    for layer, recorder in zip(runtime.layers, peaks, strict=True):
        layer.experts = recorder  # the cpu backend runs every expert on this path
    done = 0
    try:
        with runtime.recording_loads() as loads:
            for piece in pieces:
                for _ in prefill(loaded.model, piece, chunk_tokens, new_cache(loaded.model)):
                    done += 1
                    if on_chunk is not None:
                        on_chunk(done, len(chunk_lengths))
    finally:
        runtime.detach()

    counted = [i for i, n in enumerate(chunk_lengths) if n == chunk_tokens] or list(range(len(chunk_lengths)))
    layer_loads = tuple(
        (name, load_statistics(torch.stack(calls)[counted].float()))
        for name, calls in zip(runtime.names, loads, strict=True))
    return Calibration(chunk_tokens=chunk_tokens, tokens=len(stream), chunks=len(counted),
                       sources=tuple(source for source, _ in texts), layers=layer_loads,
                       magnitudes=tuple((name, recorder.magnitudes())
                                        for name, recorder in zip(runtime.names, peaks, strict=True)))


class PeakRecorder:
    """A layer's CPU experts that also keep each expert's largest absolute values, as `ExpertMagnitudes` names
    them. It computes what `CpuExperts` computes, with the same packed weights, looking at the values on the way."""

    def __init__(self, experts: CpuExperts) -> None:
        self.experts = experts
        self.peaks = torch.zeros(len(experts), len(ExpertMagnitudes.__dataclass_fields__))
        self._lock = threading.Lock()  # workers may run pieces of one expert side by side

    def __len__(self) -> int:
        return len(self.experts)

    def __call__(self, expert: int, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        experts = self.experts
        h = experts.gate_up[expert](x)
        if experts.gate_up_bias is not None:
            h += experts.gate_up_bias[expert]
        gate, up = h.chunk(2, dim=-1) if experts.layout.gate is not None else (h[..., :0], h)
        peaks = [_peak(x), _peak(up), _peak(gate)]
        gated = experts.layout.apply(h)
        y = experts.down[expert](gated, out)
        if experts.down_bias is not None:
            y += experts.down_bias[expert]
        found = torch.tensor([max(peaks[0], peaks[1], _peak(gated)), peaks[2], _peak(y)])
        with self._lock:
            torch.maximum(self.peaks[expert], found, out=self.peaks[expert])
        return y

    def magnitudes(self) -> ExpertMagnitudes:
        activation, gate, output = (tuple(float(f"{v:.4g}") for v in column) for column in self.peaks.T.tolist())
        return ExpertMagnitudes(activation=activation, gate=gate, output=output)


def _peak(t: torch.Tensor) -> float:
    return float(t.abs().amax()) if t.numel() else 0.0


def load_statistics(counts: torch.Tensor) -> ExpertLoad:
    """Per-expert mean, median, 95th percentile and max of (chunks, E) token counts."""
    def values(t: torch.Tensor) -> tuple[float, ...]:
        return tuple(round(v, 3) for v in t.tolist())

    return ExpertLoad(mean=values(counts.mean(0)), p50=values(counts.quantile(0.5, dim=0)),
                      p95=values(counts.quantile(0.95, dim=0)), max=values(counts.amax(0)))

