"""What the private train loader yields: an empty Poisson batch, batches split for virtual batching, and
the per-batch side channel from the sampler to the step. The bottom floor: no slot, engine or strategy.

* :class:`EmptyBatch`: the train loader's item for an empty Poisson batch; the strategy turns it into a
  noise-only step.
* Virtual batching (:func:`split_batch`): one logical (Poisson) batch split into physical chunks that fit
  in memory. The logical batch, and so q and ε, never depend on memory; only how many examples go through
  the model at once does. Works on any collection of tensors whose first dimension is the batch.
* The side channel (:class:`IndicesWithInfo` → :class:`SamplesWithInfo` → :class:`BatchWithInfo`): a
  sampler that needs to tell the step something about *this* batch (DPIS: each candidate's envelope and
  the epoch's released statistics) yields its index list with the info; the dataset wrapper hands it to
  the collate function, which wraps the user's batch; the strategy unwraps it before user code runs.
  Nothing is looked up later, so a prefetched batch keeps the snapshot it was drawn with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor
from torch.utils.data import Dataset


class EmptyBatch:
    """What the train loader yields for an empty Poisson batch; the strategy turns it into noise."""

    def __repr__(self) -> str:
        return "EmptyBatch()"


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


@dataclass(frozen=True)
class UnitInfo:
    """Which privacy unit each row of a batch belongs to (a user's rows, an example's augmented views).

    Rows of one unit are contiguous and clipped as one: the unit's ``reduction`` ("mean" or "sum") of its
    rows' gradients is clipped to C, so adding or removing a whole unit moves the released sum by at most C.
    ``unit_of_row`` is int64 of length R (rows), non-decreasing, with values 0 .. num_units - 1.
    """

    unit_of_row: Tensor
    reduction: Literal["mean", "sum"] = "mean"

    @property
    def num_units(self) -> int:
        return int(self.unit_of_row[-1]) + 1 if self.unit_of_row.numel() else 0

    def rows_per_unit(self) -> Tensor:
        """How many rows each unit has in this batch (int64, length ``num_units``)."""
        return self.unit_of_row.bincount(minlength=self.num_units)


class IndicesWithInfo(list[int]):
    """An index batch that carries the sampler's snapshot for it (pickles with the indices)."""

    def __init__(self, indices: list[int], info: Any) -> None:
        super().__init__(indices)
        self.info = info


class SamplesWithInfo(list[Any]):
    """The fetched examples of one batch plus the snapshot of the index batch they came from."""

    def __init__(self, samples: list[Any], info: Any) -> None:
        super().__init__(samples)
        self.info = info


class BatchWithInfo:
    """The user's collated batch and the sampler's snapshot; unwrapped by the strategy."""

    def __init__(self, batch: Any, info: Any) -> None:
        self.batch = batch
        self.info = info

    def __repr__(self) -> str:
        return f"BatchWithInfo({self.batch!r})"


class InfoDataset(Dataset[Any]):
    """Wraps a map-style dataset so that batched fetching keeps the index batch's info."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> SamplesWithInfo:
        inner = getattr(self.dataset, "__getitems__", None)
        samples = inner(list(indices)) if inner else [self.dataset[i] for i in indices]
        return SamplesWithInfo(list(samples), getattr(indices, "info", None))
