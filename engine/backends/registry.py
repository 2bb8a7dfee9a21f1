"""The backends by name: `REGISTRY` holds every backend the vocabulary names.

A backend's module is imported only when that backend is asked for, so one that brings a runtime of its own
(Core ML, CUDA) costs the others nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..vocabulary import COREML, CPU, CUDA, TORCH_STATIC
from .base import NO_OPTIONS, Backend, BackendOptions, CpuBackend, TorchStaticBackend

if TYPE_CHECKING:
    from .coreml.backend import CoreMLBackend
    from .cuda.backend import CudaBackend


def _coreml() -> type[CoreMLBackend]:
    from .coreml.backend import CoreMLBackend

    return CoreMLBackend


def _cuda() -> type[CudaBackend]:
    from .cuda.backend import CudaBackend

    return CudaBackend


# Each backend's name and how to get its class.
REGISTRY: dict[str, Callable[[], type[Backend]]] = {
    CPU: lambda: CpuBackend,
    TORCH_STATIC: lambda: TorchStaticBackend,
    COREML: _coreml,
    CUDA: _cuda,
}


def backend_class(name: str) -> type[Backend]:
    if name not in REGISTRY:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(REGISTRY)}")
    return REGISTRY[name]()


def get_backend(name: str, options: BackendOptions = NO_OPTIONS) -> Backend:
    """The backend called `name`, built with `options` (which it checks first)."""
    return backend_class(name).build(options)
