"""Where a sampled batch goes before user code sees it: the budget gate, a noise-only step, physical chunks.

An empty Poisson draw never reaches ``training_step`` (it becomes a release of pure noise), a batch the
budget cannot pay for releases nothing, and a logical batch larger than ``max_physical_batch_size`` runs
the user's step on each chunk while the engine accumulates the clipped sums and adds noise once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.optim import Optimizer

from lightning_dp.core.batches import (
    EmptyBatch,
    UnitInfo,
    batch_length,
    sampler_info_of,
    split_batch,
    unit_chunks,
    units_of,
)
from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.engine import PrivateStepEngine
from lightning_dp.strategies.loaders import RealisedSizes
from lightning_dp.strategies.refusals import budget_message


def batch_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The batch ``training_step`` got (``args``/``kwargs``): the user's batch, as every hook saw it."""
    return args[0] if args else kwargs.get("batch")


def begin_sampled_batch(
    engine: PrivateStepEngine, sizes: RealisedSizes | None, batch: Any, info: Any, trainer: Trainer | None
) -> bool:
    """Before user code sees a sampled batch: hand the sampler its snapshot for this batch (DPIS) and the
    engine the batch with its privacy units (users, augmented views), from the ``info`` the private loader
    took off the batch (None: it carried none). The batch may make one release, of its realised size, and
    only if the budget pays for it. False: the budget is spent, so the step releases nothing, user code does
    not run and training stops (a step forced past the budget stop, or a resumed run)."""
    units = None
    if info is not None:
        engine.sampler.begin_step(sampler_info_of(info))
        units = units_of(info)
    realised = sizes.next_size() if sizes is not None else None
    if realised is not None and (realised == 0) != isinstance(batch, EmptyBatch):
        realised = None  # not the batch the sizes were noted for (a loader Lightning did not get from us)
    engine.begin_batch(realised, data=batch, units=units)
    affordable = engine.affordable_steps(drawn=True)
    if affordable is None or affordable >= 1:
        return True
    engine.halt()
    if trainer is not None and not trainer.should_stop:
        rank_zero_info(
            f"lightning-dp: {budget_message(engine, trainer)} This step releases nothing; stopping."
        )
        trainer.should_stop = True
    return False


@dataclass(frozen=True)
class Chunking:
    """How a sampled batch goes through ``training_step``: whole; in physical chunks of at most ``size``
    rows that hold whole units (``max_physical_batch_size``); or, with ``isolate`` (``isolate_examples``),
    one privacy unit per chunk: one example, or all the rows of one unit (a user's rows, an example's
    augmented views), which the clipping groups as usual."""

    size: int | None = None
    isolate: bool = False

    @property
    def whole(self) -> bool:
        """The batch goes through ``training_step`` in one piece."""
        return self.size is None and not self.isolate

    def split(self, batch: Any, units: UnitInfo | None) -> list[tuple[Any, UnitInfo | None]]:
        """The physical chunks of ``batch`` in order, each with its own unit map (renumbered from 0)."""
        if self.whole or isinstance(batch, EmptyBatch):
            return [(batch, units)]
        parts = split_batch(batch, self.size, units, self.isolate)
        if units is None or len(parts) == 1:
            return [(part, units) for part in parts]
        maps = [chunk_units for _, _, chunk_units in unit_chunks(units, self.size, self.isolate)]
        return list(zip(parts, maps, strict=True))


def physical_chunks(
    batch: Any, chunking: Chunking, units: UnitInfo | None = None
) -> list[tuple[Any, UnitInfo | None]]:
    """What each forward of a sampled batch sees (the batch, or every physical chunk of whole units), each
    with that chunk's own unit map: the checks run on all of them, as the release sums all of them."""
    return chunking.split(batch, units)


def refuse_manual_chunks(module: LightningModule, chunking: Chunking) -> None:
    """Physical chunks are backpropagated by the strategy, which manual optimization does itself."""
    if not chunking.whole and not module.automatic_optimization:
        raise DPConfigurationError(
            "max_physical_batch_size needs automatic optimization; with manual optimization split the "
            "batch yourself and call engine.accumulate_chunk() between backward passes."
        )


def calls_of(batch: Any, chunking: Chunking, units: UnitInfo | None, module: LightningModule) -> int:
    """How many ``training_step`` calls a rank's share of the sampled batch takes: none for an empty one,
    else one per physical chunk (under distributed strategies the ranks make as many, see lockstep)."""
    if isinstance(batch, EmptyBatch):
        return 0
    refuse_manual_chunks(module, chunking)
    return len(chunking.split(batch, units))


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
        engine.share_release(ctx)
        optimizer.step()
    return None


def virtual_batch_step(
    user_step: Callable[..., Any],
    engine: PrivateStepEngine,
    module: LightningModule,
    batch: Any,
    chunking: Chunking,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Run the user's training_step on each physical chunk; Lightning backpropagates the last one."""
    refuse_manual_chunks(module, chunking)
    kwargs.pop("batch", None)
    *chunks, (last, last_units) = chunking.split(batch, engine.units)
    for chunk, chunk_units in chunks:
        engine.begin_chunk(batch_length(chunk), chunk_units)
        output = user_step(chunk, *args, **kwargs)
        loss = output["loss"] if isinstance(output, Mapping) else output
        if isinstance(loss, Tensor):
            loss.backward()
        engine.accumulate_chunk()
    if chunks:
        engine.begin_chunk(batch_length(last), last_units)
    return user_step(last, *args, **kwargs)
