"""Where the engine's modules stand in for the model's own: a slot (parent and name) and swapping modules in
and out of slots."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Slot:
    """Where a dense projection sits: its parent module and its name there."""

    parent: nn.Module
    leaf: str
    original: nn.Module


class SlotSwaps:
    """Modules of the engine's, each for the original in its slot: `attach` puts them in the model, `detach` the
    originals back."""

    slots: list[tuple[Slot, nn.Module]]

    def attach(self) -> None:
        for slot, module in self.slots:
            setattr(slot.parent, slot.leaf, module)

    def detach(self) -> None:
        for slot, _ in self.slots:
            setattr(slot.parent, slot.leaf, slot.original)


class NoSwaps(SlotSwaps):
    """Nothing swapped: the model's own modules run."""

    def __init__(self) -> None:
        self.slots = []
