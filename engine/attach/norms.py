"""The model's RMSNorm modules, run through the engine's own norm kernel (norm_kernel.py) while attached.

Which: modules whose exact class is in `CONVENTIONS`, a table of transformers' RMSNorm classes by where each
rounds to the input dtype (before the weight, as Llama's; after it in float32, as gpt-oss's; with a Gemma-style
1 + weight, as Qwen3-Next's). Any other class (LayerNorm, gated or unweighted norms, a class transformers may
add) stays as it is, and so do norms inside the routed-experts modules (their layers call those directly).

How: `MoeRuntime.attach` puts an `EngineRMSNorm` in each such module's place in its parent (`EngineNorms`;
detach puts the original back; no model code is patched). It calls the original module for what the kernel
does not take: a dtype other than float32 and bfloat16, a row whose elements are not adjacent, a weight whose
dtype would change the output's, autograd. Its output equals the module's up to the order of the sum of squares:
float32 within 1e-6 relative; bfloat16 exactly but for about one element in 10^5, off by one ulp (two where the
module rounds before the weight: an ulp of the normalised value, scaled by the weight).

When: always where the kernel runs (x86-64 with AVX-512 and a C compiler; elsewhere `EngineNorms.unavailable`
says why and torch's modules stay), not by measurement as the projections choose: the kernel reads and writes
each row once where the module makes five passes with an operator dispatch each, so no row count or width makes
it slower, and timing both per shape would cost more than it could save.

It runs on the caller's thread, rows not split: a norm takes about what handing work to another thread costs, so
splitting it over the engine's workers (kernels/workers.py) or a thread of its own measured slower, not faster
(torch's threads still spin on the other core after its operations).
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import norm_kernel
from ..kernels.norm_kernel import CAST_FIRST, WEIGHT_FIRST
from ..moe.model_experts import expert_layouts
from .slots import Slot, SlotSwaps

# Where each known class rounds (norm_kernel.c), the attribute holding its epsilon, and whether it scales by
# 1 + weight; keyed by the class's module and name, so that a subclass (which may compute otherwise) is not taken.
_CAST_FIRST = (CAST_FIRST, "variance_epsilon", False)
_WEIGHT_FIRST = (WEIGHT_FIRST, "variance_epsilon", False)
CONVENTIONS: dict[str, tuple[int, str, bool]] = {
    **{f"transformers.models.{family}.modeling_{family}.{name}": _CAST_FIRST for family, name in (
        ("llama", "LlamaRMSNorm"), ("qwen3", "Qwen3RMSNorm"), ("qwen2", "Qwen2RMSNorm"), ("mistral", "MistralRMSNorm"),
        ("qwen3_moe", "Qwen3MoeRMSNorm"),
        ("qwen2_moe", "Qwen2MoeRMSNorm"), ("mixtral", "MixtralRMSNorm"), ("olmoe", "OlmoeRMSNorm"),
        ("granitemoe", "GraniteMoeRMSNorm"), ("deepseek_v2", "DeepseekV2RMSNorm"),
        ("deepseek_v3", "DeepseekV3RMSNorm"), ("glm4_moe", "Glm4MoeRMSNorm"), ("glm4_moe_lite", "Glm4MoeLiteRMSNorm"),
        ("ernie4_5_moe", "Ernie4_5_MoeRMSNorm"), ("lfm2_moe", "Lfm2MoeRMSNorm"))},
    **{f"transformers.models.{family}.modeling_{family}.{name}": _WEIGHT_FIRST for family, name in (
        ("gpt_oss", "GptOssRMSNorm"), ("deepseek_v4", "DeepseekV4RMSNorm"), ("nemotron_h", "NemotronHRMSNorm"))},
    "transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextRMSNorm": (WEIGHT_FIRST, "eps", True),
}


def convention(module: nn.Module) -> tuple[int, str, bool] | None:
    """How `module` rounds (see CONVENTIONS), or None where its class is not one the kernel reproduces."""
    return CONVENTIONS.get(f"{type(module).__module__}.{type(module).__qualname__}")


class EngineRMSNorm(nn.Module):
    """An RMSNorm module's output computed by the engine's kernel; the original is kept (not as a submodule) to be
    put back and to compute what the kernel does not take, and its attributes read through this one (model code
    reads a norm's `weight`: Nemotron-H casts its input to the weight's dtype). `calls` counts the kernel's runs."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        known = convention(original)
        if known is None:
            raise ValueError(f"the norm kernel does not reproduce {type(original).__qualname__}")
        object.__setattr__(self, "original", original)  # not a submodule: the model holds one of the two at a time
        self.mode, eps_attribute, self.one_plus = known
        self.eps = float(getattr(original, eps_attribute))
        self._widen()
        self.calls = 0

    def _widen(self) -> None:
        """The original's weight as the kernel reads it (float32, 1 + weight where the class scales so); widening is
        exact. Kept with the weight's version, so that the weight changed in place (a state dict loaded) is seen."""
        weight = self.original.weight.detach()
        self.scale = (1.0 + weight.float() if self.one_plus else weight.float()).contiguous()
        self._source = _state(weight)

    def __getattr__(self, name: str) -> object:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "original" not in self.__dict__:
                raise
            return getattr(self.__dict__["original"], name)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether the kernel computes the original's output for `x` (else the original runs)."""
        weight = self.original.weight
        return (x.dtype in norm_kernel.DTYPES and x.device.type == "cpu" and x.dim() > 0
                and x.shape[-1] == self.scale.shape[0] and x.stride(-1) == 1
                and (self.mode == WEIGHT_FIRST or torch.promote_types(weight.dtype, x.dtype) == x.dtype)
                and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.takes(x):
            return self.original(x)
        self.calls += 1
        if self._source != _state(self.original.weight):
            self._widen()
        width = x.shape[-1]
        out = torch.empty(x.shape, dtype=x.dtype)
        # x's rows as a view where its leading dimensions allow one, else a copy
        norm_kernel.rms_norm(x.reshape(-1, width), self.scale, self.eps, self.mode, out.view(-1, width))
        return out

    def extra_repr(self) -> str:
        return f"{type(self.original).__qualname__}, width={self.scale.shape[0]}, eps={self.eps}"


def _state(weight: torch.Tensor) -> tuple[int, int | None]:
    """Where a weight is and how many times it was changed in place (a tensor made in inference mode keeps no
    count: such a weight is taken as it was)."""
    return weight.data_ptr(), None if weight.is_inference() else weight._version


def model_norms(model: nn.Module) -> list[tuple[str, Slot]]:
    """Every norm of the model the kernel reproduces, outside the experts modules, by qualified name, whether the
    model holds the original or an engine norm in its place now."""
    experts = [name for name, _, _ in expert_layouts(model)]
    found = []
    for name, module in model.named_modules():
        norm = module.original if isinstance(module, EngineRMSNorm) else module
        if not name or convention(norm) is None or any(name.startswith(f"{e}.") for e in experts):
            continue
        parent, _, leaf = name.rpartition(".")
        found.append((name, Slot(model.get_submodule(parent), leaf, norm)))
    return found


class EngineNorms(SlotSwaps):
    """The model's norms that the engine's kernel runs (none where it cannot run here: `unavailable` says why)."""

    def __init__(self, model: nn.Module) -> None:
        self.unavailable = norm_kernel.unavailable()
        self.slots = [] if self.unavailable else [(slot, EngineRMSNorm(slot.original))
                                                  for _, slot in model_norms(model)]
