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
  the collate function, which wraps the user's batch; the private loader takes the info off as it yields
  the batch, so every Lightning batch hook gets the user's batch, and hands it to the step that batch
  reaches. Nothing is looked up later, so a prefetched batch keeps the snapshot it was drawn with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence
from torch.utils.data import Dataset

from lightning_dp.core.errors import DPConfigurationError


class EmptyBatch:
    """What the train loader yields for an empty Poisson batch; the strategy turns it into noise."""

    def __repr__(self) -> str:
        return "EmptyBatch()"


def tensor_leaves(batch: Any) -> list[Tensor]:
    """The batch's tensors, in collection order. A ``PackedSequence`` or a nested tensor is refused by name:
    the checks and the clipping remove, replace and split examples by the rows (dimension 0) of each tensor,
    and these have none that are one example's (a packed sequence interleaves the examples' time steps)."""
    found: list[Tensor] = []

    def take(leaf: Any) -> None:  # a PackedSequence is matched whole, so the walk never rebuilds one
        if isinstance(leaf, PackedSequence):
            raise DPConfigurationError(
                "The batch holds a PackedSequence: lightning-dp removes, replaces and splits a batch's examples by "
                "the rows (dimension 0) of its tensors, and a packed sequence's rows are the time steps of several "
                "examples interleaved. Return the padded tensor and the lengths from the collate_fn and pack inside "
                "training_step or forward (torch.nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, "
                "enforce_sorted=False)): nn.LSTM, nn.GRU and nn.RNN on a packed input train with exact per-example "
                "gradients."
            )
        if leaf.is_nested:
            raise DPConfigurationError(
                "The batch holds a nested tensor: lightning-dp removes, replaces and splits a batch's examples "
                "by the rows (dimension 0) of ordinary tensors. Pad in the collate_fn "
                "(torch.nested.to_padded_tensor, or torch.nn.utils.rnn.pad_sequence) and pass the lengths or a "
                "mask along; build a nested tensor inside training_step if the model needs one."
            )
        found.append(leaf)

    apply_to_collection(batch, (PackedSequence, Tensor), take)
    return found


def batch_length(batch: Any) -> int | None:
    """Length of the batch dimension: that of the first tensor with a dimension in the collection (a batch
    with a packed sequence or a nested tensor is refused: :func:`tensor_leaves`)."""
    return next((t.shape[0] for t in tensor_leaves(batch) if t.dim() > 0), None)


def split_batch(
    batch: Any, size: int | None, units: UnitInfo | None = None, isolate: bool = False
) -> list[Any]:
    """Chunks of at most ``size`` examples; tensors without the batch dimension are passed whole.

    With ``units`` the cuts fall between units only (:func:`unit_chunks`): a unit's rows are clipped as
    one, so a unit cut in two would be clipped twice and count twice against the sensitivity. ``isolate``:
    a cut at every unit boundary (every row without units), so no two units share a chunk.
    """
    length = batch_length(batch)
    if length is None:
        return [batch]
    if units is None:
        step = 1 if isolate else size
        if step is None or length <= step:
            return [batch]
        bounds = [(start, min(start + step, length)) for start in range(0, length, step)]
    else:
        if size is not None and length <= size and not isolate:
            return [batch]
        bounds = [(start, stop) for start, stop, _ in unit_chunks(units, size, isolate)]
        if len(bounds) == 1:
            return [batch]

    def part(start: int, stop: int) -> Any:
        return apply_to_collection(
            batch, Tensor, lambda t: t[start:stop] if t.dim() > 0 and t.shape[0] == length else t
        )

    return [part(start, stop) for start, stop in bounds]


def unit_chunks(units: UnitInfo, size: int | None, isolate: bool = False) -> list[tuple[int, int, UnitInfo]]:
    """Row ranges [start, stop) of at most ``size`` rows (None: no limit) that hold whole units, packed in
    order, or one unit each with ``isolate``, with each chunk's own :class:`UnitInfo` (units renumbered
    from 0). A unit of more than ``size`` rows is refused: clipping its two halves separately would let it
    move the released sum by 2C."""
    counts = units.rows_per_unit().tolist()
    largest = max(counts, default=0)
    if size is not None and largest > size:
        raise DPConfigurationError(
            "A privacy unit (a user's rows, or an example's augmented views) has more rows than "
            f"max_physical_batch_size={size}. A unit is clipped as one, so it must fit one physical chunk: "
            "split across two chunks, each half would be clipped to C and the unit would count 2C. Raise "
            "max_physical_batch_size to at least the largest unit (examples_per_user × augmentation_multiplicity)."
        )
    chunks: list[tuple[int, int, UnitInfo]] = []
    start = stop = first = 0
    limit = math.inf if size is None else size
    for unit, count in enumerate(counts):
        if stop > start and (isolate or stop + count - start > limit):
            chunks.append((start, stop, units.slice(first, unit)))
            start, first = stop, unit
        stop += count
    if stop > start or not chunks:
        chunks.append((start, stop, units.slice(first, len(counts))))
    return chunks


@dataclass(frozen=True)
class UnitInfo:
    """Which privacy unit each row of a batch belongs to (a user's rows, an example's augmented views).

    Rows of one unit are contiguous and clipped as one: the unit's ``reduction`` ("mean" or "sum") of its
    rows' gradients is clipped to C, so adding or removing a whole unit moves the released sum by at most C.
    ``unit_of_row`` is int64 of length R (rows), non-decreasing, with values 0 .. num_units - 1.
    ``views``: each example's rows are this many augmented views of it (augmentation multiplicity), which
    are averaged before the reduction ("sum" then sums the examples' view means; "mean" is unchanged).
    ``ids``: per unit, the values a batch field may hold to name it (a user's own id and its relabelled
    index), so the mixing check can tell a user-id field from a label that happens to be constant per user.
    """

    unit_of_row: Tensor
    reduction: Literal["mean", "sum"] = "mean"
    views: int = 1
    ids: tuple[tuple[Any, ...], ...] | None = None

    @property
    def num_units(self) -> int:
        return int(self.unit_of_row[-1]) + 1 if self.unit_of_row.numel() else 0

    def rows_per_unit(self) -> Tensor:
        """How many rows each unit has in this batch (int64, length ``num_units``)."""
        return self.unit_of_row.bincount(minlength=self.num_units)

    def row_weights(self) -> Tensor:
        """w_r of each row (fp32): h_u = Σ_{r∈u} w_r g_r is the unit's gradient that is clipped; 1/n_u under
        "mean" (n_u: the unit's rows in this batch), 1/views under "sum"."""
        if self.reduction == "mean":
            return 1.0 / self.rows_per_unit().float()[self.unit_of_row]
        return torch.full(self.unit_of_row.shape, 1.0 / self.views, device=self.unit_of_row.device)

    def slice(self, first: int, stop: int) -> UnitInfo:
        """Units ``first`` .. ``stop - 1`` (renumbered from 0): the unit map of a chunk holding exactly them."""
        keep = (self.unit_of_row >= first) & (self.unit_of_row < stop)
        ids = None if self.ids is None else self.ids[first:stop]
        return UnitInfo(self.unit_of_row[keep] - first, self.reduction, self.views, ids)

    def without(self, removed: list[int]) -> tuple[list[int], UnitInfo, Tensor]:
        """The batch with whole units ``removed``: (their rows, the unit map of the rows left, renumbered
        from 0, and the original ids of the units left). A leave-one-unit-out check (units may mix their
        own rows, never another unit's) compares the units left, grouped, in both passes."""
        gone = torch.zeros(self.num_units, dtype=torch.bool)
        gone[torch.as_tensor(removed, dtype=torch.long)] = True
        gone_rows = gone.to(self.unit_of_row.device)[self.unit_of_row]
        kept_units = (~gone).nonzero().squeeze(1)
        renumber = (~gone).long().cumsum(0) - 1
        rest = renumber.to(self.unit_of_row.device)[self.unit_of_row[~gone_rows]]
        ids = None if self.ids is None else tuple(self.ids[u] for u in kept_units.tolist())
        unit_map = UnitInfo(rest, self.reduction, self.views, ids)
        return gone_rows.nonzero().squeeze(1).tolist(), unit_map, kept_units


@dataclass(frozen=True)
class WithUnits:
    """A batch's info when it carries both the sampler's own snapshot and a unit map (augmented views of a
    sampler's batch): the sampler gets ``sampler_info``, the engine ``units``."""

    sampler_info: Any
    units: UnitInfo


def units_of(info: Any) -> UnitInfo | None:
    """The unit map a batch's info carries (None: every row is its own unit)."""
    if isinstance(info, UnitInfo):
        return info
    return info.units if isinstance(info, WithUnits) else None


def sampler_info_of(info: Any) -> Any:
    """What the sampler itself put in a batch's info (``begin_step`` gets exactly that)."""
    return info.sampler_info if isinstance(info, WithUnits) else info


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
    """The user's collated batch and the sampler's snapshot, as the collate function returns them; the
    private loader unwraps it before Lightning sees the batch (``strategies.loaders.BatchInfos``)."""

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
