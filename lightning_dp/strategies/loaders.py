"""The private train loader: the sampler slot's batches in place of the user's, and the run's length.

The user's DataLoader keeps its dataset, collate function and worker settings; its sampler is replaced
by the sampler slot's batch sampler (Poisson by default), an empty draw becomes an ``EmptyBatch`` (a
noise-only step), and the number of steps the Trainer will run sets σ when a target ε is given.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader

from lightning_dp.batches import BatchWithInfo, EmptyBatch, InfoDataset
from lightning_dp.checks.integrity import BatchIntegrity
from lightning_dp.engine import PrivateStepEngine
from lightning_dp.errors import DPConfigurationError


class CollateWithEmpty:
    """The user's collate function, except that an empty index list becomes an ``EmptyBatch``."""

    def __init__(self, collate_fn: Any) -> None:
        self.collate_fn = collate_fn

    def __call__(self, samples: list[Any]) -> Any:
        batch = EmptyBatch() if len(samples) == 0 else self.collate_fn(list(samples))
        info = getattr(samples, "info", None)
        return batch if info is None else BatchWithInfo(batch, info)


class RealisedSizes(torch.utils.data.Sampler[list[int]]):
    """The sampler's batch sampler, noting how many examples each batch drew, in draw order.

    Index batches are drawn in the main process and the DataLoader delivers their batches in the
    same order (also with workers and prefetching), so the strategy reads the sizes back one per
    training step: the realised batch every layer must see on dimension 0.
    """

    def __init__(self, batches: torch.utils.data.Sampler[list[int]]) -> None:
        self.batches = batches
        self.sizes: deque[int] = deque()

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[list[int]]:
        self.sizes = deque()  # a new pass: what an abandoned iterator drew is never delivered
        return self._draw(self.sizes)

    def _draw(self, sizes: deque[int]) -> Iterator[list[int]]:
        for indices in self.batches:
            sizes.append(len(indices))
            yield indices

    def next_size(self) -> int | None:
        """The size of the batch delivered next (None when none is noted: then it is not checked)."""
        return self.sizes.popleft() if self.sizes else None


class PrivateLoader(DataLoader):
    """A DataLoader that records every batch it yields (``BatchIntegrity.sampled``), in delivery order, so
    the strategy can tell that what reaches ``training_step`` is that batch, unchanged by hooks."""

    integrity: BatchIntegrity | None = None

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        integrity = self.integrity
        if integrity is None:
            return super().__iter__()
        integrity.new_pass()
        return self._recorded(super().__iter__(), integrity)

    @staticmethod
    def _recorded(batches: Iterator[Any], integrity: BatchIntegrity) -> Iterator[Any]:
        for batch in batches:
            integrity.sampled(batch)
            yield batch


def private_loader(
    loader: DataLoader,
    batches: RealisedSizes,
    carries_batch_info: bool,
    integrity: BatchIntegrity | None = None,
) -> DataLoader:
    """The user's loader with the sampler slot's ``batches``; its workers and memory settings kept."""
    private = PrivateLoader(
        InfoDataset(loader.dataset) if carries_batch_info else loader.dataset,
        batch_sampler=batches,
        collate_fn=CollateWithEmpty(loader.collate_fn),
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        persistent_workers=loader.persistent_workers,
        prefetch_factor=loader.prefetch_factor if loader.num_workers > 0 else None,
    )
    private.integrity = integrity
    return private


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
