"""Virtual batching: split one logical (Poisson) batch into physical chunks that fit in memory.

The logical batch, and so q and ε, never depend on memory; only how many examples go through the
model at once does. Works on any collection of tensors whose first dimension is the batch.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor


def batch_length(batch: Any) -> int | None:
    """Length of the batch dimension: that of the first tensor found in the collection."""
    found: list[int] = []
    apply_to_collection(batch, Tensor, lambda t: found.append(t.shape[0]) if t.dim() > 0 else None)
    return found[0] if found else None


def split_batch(batch: Any, size: int) -> list[Any]:
    """Chunks of at most ``size`` examples; tensors without the batch dimension are passed whole."""
    length = batch_length(batch)
    if length is None or length <= size:
        return [batch]
    starts = range(0, length, size)

    def part(start: int) -> Any:
        return apply_to_collection(
            batch, Tensor, lambda t: t[start : start + size] if t.dim() > 0 and t.shape[0] == length else t
        )

    return [part(start) for start in starts]
