"""What the engine is told of the sampled batch it steps on, and the chunk sums it holds until the release.

The strategy hands these in through the engine's methods (``begin_batch``, ``begin_chunk``, ``halt``); the
engine alone writes them, so what a release reads is what the strategy said of this batch and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from lightning_dp.core.batches import UnitInfo


@dataclass(frozen=True)
class SampledBatch:
    """One sampled batch as the strategy announced it (``PrivateStepEngine.begin_batch``).

    ``realised``: examples the sampler drew (None: not known, so unchecked); ``data``: the batch user code
    sees (steps that query the loss again evaluate it); ``units``: the privacy units of its rows (None: every
    row is its own unit)."""

    realised: int | None = None
    data: Any = None
    units: UnitInfo | None = None


@dataclass(frozen=True)
class Chunk:
    """The rows about to be backpropagated: the whole batch, or one physical chunk of whole units under
    virtual batching (``PrivateStepEngine.begin_chunk``), with that chunk's own unit map."""

    rows: int | None = None
    units: UnitInfo | None = None


class PendingChunks:
    """Virtual batching: the clipped sums of the physical chunks backpropagated so far in one logical
    batch, with the units and rows they cover; the release adds the last chunk's and noises the total once."""

    def __init__(self) -> None:
        self.sums: list[Tensor] | None = None
        self.units = 0
        self.rows = 0

    @property
    def empty(self) -> bool:
        return self.sums is None

    def add(self, sums: list[Tensor], units: int, rows: int) -> None:
        """Fold one chunk's clipped sums (over ``units`` units and ``rows`` rows) into the pending total."""
        self.sums = sums if self.sums is None else [a + b for a, b in zip(self.sums, sums, strict=True)]
        self.units += units
        self.rows += rows

    def take(self) -> tuple[list[Tensor] | None, int, int]:
        """The pending (sums, units, rows), emptied: the release that ends the logical batch consumes them."""
        taken = (self.sums, self.units, self.rows)
        self.drop()
        return taken

    def drop(self) -> None:
        """Forget the pending chunks (a refused release: nothing of them may reach a later step)."""
        self.sums, self.units, self.rows = None, 0, 0
