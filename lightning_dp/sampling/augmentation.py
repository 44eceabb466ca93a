"""Augmentation multiplicity (De et al. 2022, arXiv 2204.13650 §3.1): K augmented views of each sampled
example, whose gradients are averaged before the example is clipped.

h_i = (1/K) Σ_j ∇ℓ(θ; a_j(x_i)) is clipped to C, so each example still moves the released sum by at most C
and ε is DP-SGD's at the same (σ, q, T): K appears nowhere in the ledger. The views are the train
``Dataset``'s own: it is called K times per index, so its random transforms draw K times. The collate
flattens [B, K, ...] to [B·K, ...] (each view's label with it) and the batch carries the unit map
``arange(B).repeat_interleave(K)`` (:class:`~lightning_dp.core.batches.UnitInfo`): the engine groups each
example's K rows before the clipping. With a sampler whose batches already carry units (users), the unit
stays the sampler's (a user's rows are then its examples × K views): :func:`with_views`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

from lightning_dp.core.batches import UnitInfo, WithUnits, units_of


class Views(tuple[Any, ...]):
    """The K augmented views of one example, as :class:`AugmentedDataset` returns them."""


class AugmentedDataset(Dataset[Any]):
    """The train data set, each item drawn ``views`` times (its random transforms run once per view)."""

    def __init__(self, dataset: Any, views: int) -> None:
        self.dataset, self.views = dataset, views

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Views:
        return Views(self.dataset[index] for _ in range(self.views))


def with_views(info: Any, examples: int, views: int) -> WithUnits:
    """The info of a batch of ``examples`` sampled items, each now ``views`` consecutive rows: the sampler's
    own info is kept for it; the units are the sampler's (each row repeated ``views`` times), else one
    unit per example, averaged over its views."""
    units = units_of(info)
    if units is None:
        unit_of_row = torch.arange(examples).repeat_interleave(views)
        return WithUnits(info, UnitInfo(unit_of_row, "mean", views))
    if units.unit_of_row.numel() != examples:
        raise ValueError(
            f"the sampler's unit map has {units.unit_of_row.numel()} rows for {examples} examples"
        )
    return WithUnits(
        info,
        UnitInfo(units.unit_of_row.repeat_interleave(views), units.reduction, units.views * views, units.ids),
    )


def flatten_views(samples: list[Any], views: int) -> tuple[list[Any], WithUnits]:
    """The B·K rows of a fetched batch of :class:`Views` (each example's views consecutive, so the user's
    collate stacks [B, K, ...] as [B·K, ...], labels repeated) and the info their batch carries."""
    rows = [view for item in samples for view in item]
    return rows, with_views(getattr(samples, "info", None), len(samples), views)
