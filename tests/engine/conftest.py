"""Shared fixtures: tiny checkpoints (made once per session) and the two test texts."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from npumoe.engine.tiny import make_tiny

TEXTS = Path(__file__).parent / "texts"


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Tiny models on a shared 2-core machine: one thread avoids oversubscription stalls."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """tiny(arch, seed=0): the folder of a tiny checkpoint, written once per session."""
    made: dict[tuple[str, int], Path] = {}

    def get(arch: str, seed: int = 0) -> Path:
        if (arch, seed) not in made:
            made[arch, seed] = make_tiny(arch, tmp_path_factory.mktemp(f"{arch}-{seed}") / "model", seed=seed)
        return made[arch, seed]

    return get


@pytest.fixture(scope="session")
def harbour() -> str:
    return (TEXTS / "harbour.txt").read_text()


@pytest.fixture(scope="session")
def orchard() -> str:
    return (TEXTS / "orchard.txt").read_text()
