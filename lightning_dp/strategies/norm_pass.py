"""What a model-dependent sampler (DPIS) borrows from the strategy: a norm pass over the data and the plan.

The norm pass computes per-example gradient norms of chosen training examples at the current weights;
nothing is released by it (the sampler prices what it publishes about them in its own events).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_dp.checks.user_step import training_step_loss
from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.engine import PrivateStepEngine
from lightning_dp.slots import SamplerRuntime

ToDevice = Callable[[Any], Any]


def example_norms(
    engine: PrivateStepEngine,
    module: LightningModule,
    loader: DataLoader,
    indices: Tensor,
    to_device: ToDevice,
    chunk: int,
) -> Tensor:
    """Per-example gradient norms of ``loader.dataset[indices]`` at the current weights, ``chunk`` at a time.

    The loss is the module's ``dp_per_sample_loss(batch)`` when it has one, else its ``training_step``
    (with logging detached, so the pass leaves no trace in the metrics).
    """
    dataset = loader.dataset
    per_sample = getattr(module, "dp_per_sample_loss", None)
    mean = engine.loss_reduction == "mean"

    def batches() -> Iterator[Any]:
        for start in range(0, len(indices), chunk):
            samples = [dataset[int(i)] for i in indices[start : start + chunk]]
            yield to_device(loader.collate_fn(samples))

    def loss_fn(batch: Any) -> Tensor:
        if per_sample is not None:
            losses = per_sample(batch)
            return losses.mean() if mean else losses.sum()
        loss = training_step_loss(module, batch)
        if loss is None:
            raise DPConfigurationError("DPIS's norm pass needs training_step to return the loss.")
        return loss

    was_training = module.training
    module.train()
    try:
        return engine.example_norms(batches(), loss_fn)
    finally:
        module.train(was_training)


def sampler_runtime(
    engine: PrivateStepEngine,
    module: LightningModule,
    loader: DataLoader,
    device: torch.device,
    to_device: ToDevice,
    *,
    planned_steps: int,
    steps_per_epoch: int,
    chunk: int,
) -> SamplerRuntime:
    """The norm pass, the ledger, the plan and (on several processes) a CPU all-reduce, for ``engine.sampler``."""
    all_reduce = engine.all_reduce

    def cpu_all_reduce(tensors: list[Tensor]) -> list[Tensor]:
        assert all_reduce is not None
        return [t.cpu() for t in all_reduce([t.to(device) for t in tensors])]

    noise = engine.noise
    return SamplerRuntime(
        norms=lambda indices: example_norms(engine, module, loader, indices, to_device, chunk),
        ledger=engine.ledger,
        target_epsilon=engine.target_epsilon,
        delta=engine.delta,
        planned_steps=planned_steps,
        steps_per_epoch=steps_per_epoch,
        max_grad_norm=engine.max_grad_norm,
        fixed_noise_multiplier=noise.noise_multiplier(0) if noise.is_set else None,
        clipping=engine.clipping,
        all_reduce=cpu_all_reduce if all_reduce is not None else None,
    )
