"""A per-batch side channel from the sampler to the private step that survives DataLoader prefetching.

A sampler that needs to tell the step something about *this* batch (DPIS: each candidate's envelope
and the epoch's released statistics) yields its index list as :class:`IndicesWithInfo`. The dataset
wrapper hands the info to the collate function, which wraps the user's batch in :class:`BatchWithInfo`;
the strategy unwraps it before user code runs. Nothing is looked up later, so a prefetched batch keeps
the snapshot it was drawn with.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset


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
