"""`weights = "auto"`: the weights format the machine decides.

The fastest float dtype measured here (float_kernels: one expert's matmuls timed in each dtype's fastest kernel;
bf16 wins where the CPU has it natively, fp32 where bf16 is emulated), unless the model would not fit this
machine's memory in it (model_size's rule: the weights' bytes with their run overhead against what the machine
leaves the daemon); then the first smaller format that fits, from bf16 through int8 to int4 (the least rounding
that fits), and int4 when none does.

A GGUF file whose experts are stored quantized is never widened to a float format: auto starts from the format the
file's type loads into without widening (gguf_load.experts_format: a Q4_K_M, Q4_0 or IQ3 file int4, even where
llama.cpp stored some experts in Q5_0 or Q6_K; Q5_x, Q6_K and Q8_0 files int8; without a recorded type, that of
the block type most expert weights are in), and goes down to int4 only if that does not fit. int4 runs on every
machine (its dequantizing kernel at least), so a 4-bit file is never widened to int8. Float GGUF files go as
checkpoints do.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ..kernels import bf16_linear, float_kernels
from ..kernels.choice import Measured
from ..moe.experts_layout import expert_weights
from ..moe.model_experts import expert_layouts
from ..vocabulary import BF16, FP32, INT4, INT8
from .gguf_load import experts_format, gguf_config, is_gguf
from .model_size import ModelSize, checkpoint_tensors, model_size, needed_bytes, usable_bytes

_FLOATS = {FP32: torch.float32, BF16: torch.bfloat16}
# The float kernels' sources: an edited kernel is timed again.
CHOICES = Measured("auto weights", (bf16_linear.SOURCE,))
_GIB = 2**30


@dataclass(frozen=True)
class WeightsChoice:
    weights: str
    reason: str  # one line: what was measured and compared
    fits: bool = True  # False: not even the smallest format fits this machine's memory


def choose_model_weights(model: str, *, allow_download: bool = False,
                         trust_remote_code: bool = False) -> tuple[str, WeightsChoice]:
    """(the model's name, the format `auto` stands for) for a local folder, a GGUF file or a Hugging Face id
    (ModelError when it cannot be found)."""
    from .resolve import model_folder

    checkpoint, name = model_folder(model, allow_download=allow_download, trust_remote_code=trust_remote_code)
    return name, choose_weights(checkpoint, trust_remote_code=trust_remote_code)


def choose_weights(checkpoint: Path, total_memory: int | None = None, *,
                   trust_remote_code: bool = False) -> WeightsChoice:
    """The format `auto` stands for when loading `checkpoint` on this machine (with `total_memory` bytes of RAM,
    this machine's by default)."""
    stored = experts_format(checkpoint) if is_gguf(checkpoint) else None
    if stored is not None:
        return _stored_choice(checkpoint, stored, total_memory)
    seconds = float_seconds(*expert_sizes(checkpoint, trust_remote_code=trust_remote_code))
    fastest = min(seconds, key=seconds.__getitem__)
    timing = ", ".join(f"{name} {s * 1e3:.3g} ms" for name, s in seconds.items())
    size = model_size(checkpoint_tensors(checkpoint))
    usable = usable_bytes(total_memory if total_memory is not None else psutil.virtual_memory().total)
    if _fits(size, fastest, usable):
        return WeightsChoice(fastest, f"{fastest}, the fastest float dtype measured here per expert ({timing}); "
                                      f"needs {_gib(size, fastest)} of {usable / _GIB:.1f} GiB usable")
    smaller = sorted((f for f in (BF16, INT8, INT4) if _bytes(size, f) < _bytes(size, fastest)),
                     key=lambda f: -_bytes(size, f))
    chosen = next((f for f in smaller if _fits(size, f, usable)), INT4)
    fits = _fits(size, chosen, usable)
    return WeightsChoice(chosen, f"{chosen}: {fastest}, the fastest float dtype here ({timing}), needs "
                                 f"{_gib(size, fastest)}, more than the {usable / _GIB:.1f} GiB usable; {chosen} "
                                 f"needs {_gib(size, chosen)} and "
                                 f"{'fits' if fits else 'does not fit either, the smallest format there is'}", fits)


def _stored_choice(file: Path, stored: str, total_memory: int | None) -> WeightsChoice:
    """The format auto stands for a GGUF file whose experts are stored in blocks that load into `stored`."""
    size = model_size(checkpoint_tensors(file))
    usable = usable_bytes(total_memory if total_memory is not None else psutil.virtual_memory().total)
    chosen = next((f for f in (INT8, INT4) if _bytes(size, f) <= _bytes(size, stored) and _fits(size, f, usable)),
                  INT4)
    fits = _fits(size, chosen, usable)
    why = f"the file's experts are stored quantized ({stored} holds them without widening them; never a float format)"
    if chosen == stored:
        return WeightsChoice(chosen, f"{chosen}: {why}; needs {_gib(size, chosen)} of {usable / _GIB:.1f} GiB usable",
                             fits)
    return WeightsChoice(chosen, f"{chosen}: {why}, but {stored} needs {_gib(size, stored)}, more than the "
                                 f"{usable / _GIB:.1f} GiB usable; {chosen} needs {_gib(size, chosen)} and "
                                 f"{'fits' if fits else 'does not fit either, the smallest format there is'}", fits)


def expert_sizes(checkpoint: Path, *, trust_remote_code: bool = False) -> tuple[int, int]:
    """(hidden, ffn) of one routed expert, read from the experts modules of the model built from the checkpoint's
    config on the meta device (nothing read or allocated): the modules the engine runs, whatever names the
    checkpoint stores their tensors under (GraniteMoE's block_sparse_moe.input_linear, gpt-oss's fused or MXFP4
    experts); a dense model's FFN (hidden, intermediate_size), the one expert every token takes."""
    config = gguf_config(checkpoint) if is_gguf(checkpoint) else \
        AutoConfig.from_pretrained(checkpoint, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    found = expert_layouts(model)
    if not found:
        return config.hidden_size, config.intermediate_size
    _, experts, layout = found[0]
    weights = expert_weights(experts, layout)
    return weights.hidden, weights.ffn


def float_seconds(hidden: int, ffn: int) -> dict[str, float]:
    """Seconds of one expert of these sizes in each float format's fastest kernel here: measured the first time on
    this machine, then read from the user cache (so that auto costs a load nothing after the first, and decides
    the same way every time)."""
    # no accuracy probe: each format's kernel passed its own in float_kernels, and the formats differ by design
    return CHOICES.choose(None, float_kernels.expert_shape(hidden, ffn), list(_FLOATS),
                          lambda names: {name: expert_seconds(hidden, ffn, _FLOATS[name]) for name in names},
                          threads=1).seconds


def expert_seconds(hidden: int, ffn: int, dtype: torch.dtype) -> float:
    """Seconds of one expert's matmuls in `dtype`'s fastest kernel here (measured once per machine, cached)."""
    choice = float_kernels.choose_for_shape(hidden, ffn, dtype)
    if choice.seconds:
        return choice.seconds[choice.winner]
    # only one kernel runs here: nothing was compared, so time it on its own
    generator = torch.Generator().manual_seed(0)
    gate_up = torch.randn(1, 2 * ffn, hidden, generator=generator).to(dtype)
    down = torch.randn(1, hidden, ffn, generator=generator).to(dtype)
    return float_kernels.time_kernels([choice.winner], gate_up, down)[choice.winner]


def _bytes(size: ModelSize, format: str) -> int:
    return size.formats[format].total_bytes


def _fits(size: ModelSize, format: str, usable: int) -> bool:
    return needed_bytes(_bytes(size, format)) <= usable


def _gib(size: ModelSize, format: str) -> str:
    return f"{needed_bytes(_bytes(size, format)) / _GIB:.1f} GiB"
