"""The private train loader: the sampler slot's batches in place of the user's, and the run's length.

The user's DataLoader keeps its dataset, collate function and worker settings; its sampler is replaced
by the sampler slot's batch sampler (Poisson by default), an empty draw becomes an ``EmptyBatch`` (a
noise-only step), and the number of steps the Trainer will run sets σ when a target ε is given.
"""

from __future__ import annotations

import random
import types
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader

from lightning_dp.checks.collate_order import collate_in_order
from lightning_dp.checks.integrity import BatchIntegrity
from lightning_dp.core.batches import BatchWithInfo, EmptyBatch, InfoDataset, units_of
from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.engine import PrivateStepEngine
from lightning_dp.sampling.augmentation import AugmentedDataset, flatten_views


class CollateWithEmpty:
    """The user's collate function, except that an empty index list becomes an ``EmptyBatch``; with
    ``views`` > 1 (augmentation multiplicity) it collates every example's views as consecutive rows and
    the batch carries its unit map (:func:`~lightning_dp.sampling.augmentation.flatten_views`). A batch whose rows
    carry privacy units is collated in order or refused (:func:`~lightning_dp.checks.collate_order.collate_in_order`):
    each row keeps the unit of the item fetched at its position."""

    def __init__(self, collate_fn: Any, views: int = 1) -> None:
        self.collate_fn, self.views = collate_fn, views
        self.probe = random.Random(0x0DE5)
        """Draws the other order the collate check collates a batch in (its own stream: no global draw)."""

    def __call__(self, samples: list[Any]) -> Any:
        info = getattr(samples, "info", None)
        if len(samples) == 0:
            return EmptyBatch() if info is None else BatchWithInfo(EmptyBatch(), info)
        rows = list(samples)
        if self.views > 1:
            rows, info = flatten_views(samples, self.views)
        units = units_of(info)
        if units is None:
            batch = self.collate_fn(rows)
        else:
            batch = collate_in_order(self.collate_fn, rows, units, self.probe)
        return batch if info is None else BatchWithInfo(batch, info)


class RealisedSizes(torch.utils.data.Sampler[list[int]]):
    """The sampler's batch sampler, noting how many examples each batch drew, in draw order.

    Index batches are drawn in the main process and the DataLoader delivers their batches in the
    same order (also with workers and prefetching), so the strategy reads the sizes back one per
    training step: the realised batch every layer must see on dimension 0.
    """

    def __init__(self, batches: torch.utils.data.Sampler[list[int]], views: int = 1) -> None:
        self.batches = batches
        self.views = views
        """Rows per drawn index (augmentation multiplicity): the sizes noted are rows."""
        self.sizes: deque[int] = deque()

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[list[int]]:
        self.sizes = deque()  # a new pass: what an abandoned iterator drew is never delivered
        return self._draw(self.sizes)

    def _draw(self, sizes: deque[int]) -> Iterator[list[int]]:
        for indices in self.batches:
            sizes.append(len(indices) * self.views)
            yield indices

    def next_size(self) -> int | None:
        """The size of the batch delivered next (None when none is noted: then it is not checked)."""
        return self.sizes.popleft() if self.sizes else None


class BatchInfos:
    """The side-channel info of each batch the private loader yields (None for a batch without any), taken
    off the batch as it leaves the loader and handed to the strategy in delivery order: every Lightning
    batch hook then gets the user's own batch, and ``training_step`` the info of exactly the batch it runs
    (Lightning delivers each batch to one step, in order; an iterator abandoned at an epoch's end, or by
    an ``on_train_batch_start`` that returns -1, is followed by a new pass, which drops what it prefetched)."""

    def __init__(self) -> None:
        self.pending: deque[Any] = deque()

    def new_pass(self) -> None:
        """A new iterator over the train loader: infos of batches an abandoned one prefetched are dropped."""
        self.pending.clear()

    def take(self, batch: Any) -> Any:
        """The user's batch inside ``batch``; its info is noted for the step it reaches."""
        if isinstance(batch, BatchWithInfo):
            self.pending.append(batch.info)
            return batch.batch
        self.pending.append(None)
        return batch

    def next_info(self) -> Any:
        """The info of the batch delivered next (None when it had none, or came from another loader)."""
        return self.pending.popleft() if self.pending else None


class PrivateLoader(DataLoader):
    """A DataLoader that yields the user's collated batches, with the side-channel info taken off them
    (``infos``), and records every batch it yields (``BatchIntegrity.sampled``), in delivery order, so the
    strategy can tell that what reaches ``training_step`` is that batch, unchanged by hooks."""

    integrity: BatchIntegrity | None = None
    infos: BatchInfos | None = None

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        integrity, infos = self.integrity, self.infos
        if integrity is None and infos is None:
            return super().__iter__()
        if integrity is not None:
            integrity.new_pass()
        if infos is not None:
            infos.new_pass()
        return self._delivered(super().__iter__(), integrity, infos)

    @staticmethod
    def _delivered(
        batches: Iterator[Any], integrity: BatchIntegrity | None, infos: BatchInfos | None
    ) -> Iterator[Any]:
        for batch in batches:
            if infos is not None:
                batch = infos.take(batch)
            if integrity is not None:
                integrity.sampled(batch)
            yield batch


def private_loader(
    loader: DataLoader,
    batches: RealisedSizes,
    carries_batch_info: bool,
    integrity: BatchIntegrity | None = None,
    views: int = 1,
    dataset: Any = None,
    infos: BatchInfos | None = None,
) -> DataLoader:
    """The user's loader with the sampler slot's ``batches``; its workers and memory settings kept.
    ``views`` > 1: each drawn example is fetched that many times (augmentation multiplicity).
    ``dataset``: what the batches index, when not the loader's own (a run's contribution-bounded subset).
    ``infos``: where each batch's side-channel info goes (units, a sampler's snapshot) as it is yielded."""
    dataset = loader.dataset if dataset is None else dataset
    dataset = AugmentedDataset(dataset, views) if views > 1 else dataset
    private = PrivateLoader(
        InfoDataset(dataset) if carries_batch_info else dataset,
        batch_sampler=batches,
        collate_fn=CollateWithEmpty(loader.collate_fn, views),
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        persistent_workers=loader.persistent_workers,
        prefetch_factor=loader.prefetch_factor if loader.num_workers > 0 else None,
    )
    private.integrity = integrity
    private.infos = infos
    return private


@dataclass(frozen=True)
class BoundData:
    """The training set the sampler was bound to in this run: the data set, N and the logical batch."""

    dataset: Any
    num_samples: int
    logical_batch: int


def check_reloaded_data(bound: BoundData | None, now: BoundData, public: bool) -> BoundData:
    """A train loader set up again in a run (``reload_dataloaders_every_n_epochs``, a second fit) must hold the
    same data as the one the sampler was first bound to: the same N, the same batch size (so the same q) and
    the same examples. Returns what the run is bound to from now on.

    A change read from private data (a self-paced curriculum that keeps the examples with a low loss) makes
    N, q and the choice of examples a release without noise. ``public``: the user declared that no private
    data decides the change, so each epoch's N and q are priced as they come. Checked before the next release.
    """
    if bound is None or public:
        return now
    before_q, q = bound.logical_batch / bound.num_samples, now.logical_batch / now.num_samples
    if now.num_samples != bound.num_samples:
        change = (
            f"the training set went from N={bound.num_samples} to N={now.num_samples} examples "
            f"(q from {before_q:.6g} to {q:.6g})"
        )
    elif now.logical_batch != bound.logical_batch:
        change = f"batch_size changed q from {before_q:.6g} to {q:.6g}"
    elif not same_data(bound.dataset, now.dataset):
        change = f"it returns a different data set of the same size (N={now.num_samples})"
    else:
        return bound
    raise DPConfigurationError(
        f"The train loader changed during the run: {change}. Which examples train, and how many, would then "
        "be read from the training data without noise (a curriculum that picks examples by their loss), and "
        "the ledger does not price that choice. Return the same data set every epoch (the same object, or one "
        "with the same contents), or, if no private data decides the change (a fixed, public schedule), pass "
        "DPStrategy(checks=Checks(data_changes='public')): each epoch's N and q are then priced as they are."
    )


_MAX_DEPTH = 8


def same_data(a: Any, b: Any, depth: int = 0) -> bool:
    """Whether two data sets hold the same examples, by a cheap structural comparison: the same object, or
    the same type with equal tensors, arrays, index lists and settings (a ``Subset`` of the same data with
    the same indices, a ``TensorDataset`` over equal tensors). False whenever it cannot tell."""
    if a is b:
        return True
    if type(a) is not type(b) or depth > _MAX_DEPTH:
        return False
    if isinstance(a, torch.Tensor):
        if (a.shape, a.dtype, a.device) != (b.shape, b.dtype, b.device):
            return False
        return bool(
            torch.equal(a, b)
            or (
                a.is_floating_point()
                and torch.equal(a.isnan(), b.isnan())
                and torch.equal(a.nan_to_num(), b.nan_to_num())
            )
        )
    if isinstance(a, np.ndarray):
        if (a.shape, a.dtype) != (b.shape, b.dtype):
            return False
        return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if isinstance(a, (bool, int, float, complex, str, bytes, type(None), range)):
        return bool(a == b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_data(x, y, depth + 1) for x, y in zip(a, b, strict=True))
    if isinstance(a, Mapping):
        return a.keys() == b.keys() and all(same_data(a[k], b[k], depth + 1) for k in a)
    if isinstance(a, types.MethodType):
        return a.__func__ is b.__func__ and same_data(a.__self__, b.__self__, depth + 1)
    if isinstance(a, types.FunctionType | types.BuiltinFunctionType) or not hasattr(a, "__dict__"):
        return False  # two different functions, or an object whose state cannot be read: cannot tell
    return same_data(vars(a), vars(b), depth + 1)


def _limited_batches(trainer: Trainer, num_batches: int) -> int:
    """The batches of an epoch that ``limit_train_batches`` lets run (an int caps, a float scales)."""
    limit = trainer.limit_train_batches
    if isinstance(limit, int):
        return min(num_batches, limit)
    return int(num_batches * float(limit)) if limit is not None else num_batches


def steps_per_epoch(trainer: Trainer, num_batches: int) -> int:
    """Optimizer steps in one epoch of ``num_batches`` batches under ``limit_train_batches`` (at least 1)."""
    return max(1, _limited_batches(trainer, num_batches))


def planned_steps(trainer: Trainer, num_batches: int) -> int:
    """Optimizer steps the Trainer will run, from max_epochs, max_steps and limit_train_batches."""
    per_epoch = _limited_batches(trainer, num_batches)
    max_epochs = trainer.fit_loop.max_epochs
    max_steps = trainer.max_steps
    by_epochs = per_epoch * max_epochs if max_epochs is not None and max_epochs >= 0 else None
    by_steps = max_steps if max_steps is not None and max_steps >= 0 else None
    candidates = [n for n in (by_epochs, by_steps) if n is not None]
    if not candidates:
        raise DPConfigurationError(
            "Calibrating σ from target_epsilon needs a finite training length: set max_epochs or max_steps "
            "(or give noise_multiplier directly)."
        )
    return max(1, min(candidates))


def calibrate(engine: PrivateStepEngine, steps: int) -> None:
    """Set the noise slot's σ so that ``steps`` steps spend the target ε (and say so once)."""
    target = engine.target_epsilon
    assert target is not None
    try:
        engine.noise.calibrate(target, engine.delta, engine.sampler, steps, engine.accountant)
    except ValueError as err:
        raise DPConfigurationError(f"target_epsilon={target} cannot be met: {err}") from err
    rank_zero_info(
        f"lightning-dp: noise multiplier {engine.noise.noise_multiplier(0):.4f} for ε={target:g} over "
        f"{steps} steps (q={engine.sampler.sample_rate:.5f})"
    )


def first_sigma(engine: PrivateStepEngine) -> float | None:
    """The noise slot's σ of the first step, once set (None while a sampler schedules it)."""
    noise = engine.noise
    return noise.noise_multiplier(0) if noise.is_set and not engine.sampler.schedules_noise else None
