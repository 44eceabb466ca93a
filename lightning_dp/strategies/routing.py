"""Where a sampled batch goes before user code sees it: the budget gate, a noise-only step, physical chunks.

An empty Poisson draw never reaches ``training_step`` (it becomes a release of pure noise), a batch the
budget cannot pay for releases nothing, and a logical batch larger than ``max_physical_batch_size`` runs
the user's step on each chunk while the engine accumulates the clipped sums and adds noise once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.optim import Optimizer

from lightning_dp.batches import (
    BatchWithInfo,
    EmptyBatch,
    UnitInfo,
    batch_length,
    sampler_info_of,
    split_batch,
    unit_chunks,
    units_of,
)
from lightning_dp.engine import PrivateStepEngine
from lightning_dp.errors import DPConfigurationError
from lightning_dp.strategies.loaders import RealisedSizes
from lightning_dp.strategies.refusals import budget_message


def unwrap_batch_info(
    engine: PrivateStepEngine, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """Hand the sampler its snapshot for this batch (DPIS) and the engine the batch's privacy units (users,
    augmented views), and give user code the batch alone."""
    batch = args[0] if args else kwargs.get("batch")
    engine.units = None
    if isinstance(batch, BatchWithInfo):
        engine.sampler.begin_step(sampler_info_of(batch.info))
        engine.units = units_of(batch.info)
        batch = batch.batch
        if args:
            args = (batch, *args[1:])
        else:
            kwargs["batch"] = batch
    return batch, args, kwargs


def begin_sampled_batch(
    engine: PrivateStepEngine, sizes: RealisedSizes | None, batch: Any, trainer: Trainer | None
) -> bool:
    """Before user code sees a sampled batch: it may make one release, of its realised size, and only
    if the budget pays for it. False: the budget is spent, so the step releases nothing, user code does
    not run and training stops (a step forced past the budget stop, or a resumed run)."""
    realised = sizes.next_size() if sizes is not None else None
    if realised is not None and (realised == 0) != isinstance(batch, EmptyBatch):
        realised = None  # not the batch the sizes were noted for (a loader Lightning did not get from us)
    engine.begin_batch(realised)
    affordable = engine.affordable_steps(drawn=True)
    if affordable is None or affordable >= 1:
        return True
    engine.halted = True
    if trainer is not None and not trainer.should_stop:
        rank_zero_info(
            f"lightning-dp: {budget_message(engine, trainer)} This step releases nothing; stopping."
        )
        trainer.should_stop = True
    return False


def first_chunk(batch: Any, chunk_size: int | None, units: UnitInfo | None = None) -> Any:
    """What the first forward of a sampled batch sees: the batch, or its first physical chunk (whole units)."""
    if chunk_size is None or isinstance(batch, EmptyBatch):
        return batch
    return split_batch(batch, chunk_size, units)[0]


def noise_only_step(
    engine: PrivateStepEngine, module: LightningModule, optimizers: Sequence[Optimizer], device: torch.device
) -> Tensor | None:
    """An empty batch's step: the same release as any other step, of noise alone."""
    if module.automatic_optimization:
        # A graph leaf so Lightning's backward runs and post_backward releases pure noise.
        return torch.zeros((), device=device, requires_grad=True)
    # One noise-only release for the batch; every optimizer then steps on its share of it.
    for optimizer in optimizers:
        optimizer.zero_grad()
    ctx = engine.noise_only_step()
    for optimizer in optimizers:
        engine.pending_ctx = ctx
        optimizer.step()
    return None


def virtual_batch_step(
    user_step: Callable[..., Any],
    engine: PrivateStepEngine,
    module: LightningModule,
    batch: Any,
    chunk_size: int,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Run the user's training_step on each physical chunk; Lightning backpropagates the last one."""
    if not module.automatic_optimization:
        raise DPConfigurationError(
            "max_physical_batch_size needs automatic optimization; with manual optimization split the "
            "batch yourself and call engine.accumulate_chunk() between backward passes."
        )
    kwargs.pop("batch", None)
    units = engine.units
    parts = split_batch(batch, chunk_size, units)
    unit_maps: list[UnitInfo | None] = [units] * len(parts)
    if units is not None and len(parts) > 1:
        unit_maps = [chunk_units for _, _, chunk_units in unit_chunks(units, chunk_size)]
    *chunks, last = parts
    for chunk, chunk_units in zip(chunks, unit_maps[:-1], strict=True):
        engine.chunk_batch = batch_length(chunk)
        engine.units = chunk_units  # whole units: each is clipped once, over all its rows
        output = user_step(chunk, *args, **kwargs)
        loss = output["loss"] if isinstance(output, Mapping) else output
        if isinstance(loss, Tensor):
            loss.backward()
        engine.accumulate_chunk()
    if chunks:
        engine.chunk_batch = batch_length(last)
        engine.units = unit_maps[-1]
    return user_step(last, *args, **kwargs)
