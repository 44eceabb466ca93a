"""DPDDPStrategy: DP-SGD across processes, GPUs and nodes on Lightning's own DDP machinery.

Each rank computes per-example gradients of its own share of the Poisson batch and clips them; each
adds an independent noise share σC/√W from its own generator; one all-reduce of the noisy clipped
sums gives every rank the same private gradient. No torch DDP reducer runs on the non-private
gradient (the model is not wrapped), so there is exactly one collective per step.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor

from lightning_dp.grad_sample import GradMode
from lightning_dp.prepare import OnBatchNorm
from lightning_dp.slots import Clipping, Noise, Sampler, Step
from lightning_dp.strategy import DPStrategyMixin


def all_reduce_sum(tensors: list[Tensor]) -> list[Tensor]:
    """Sum a list of tensors over all ranks with one collective (flattened into one buffer)."""
    if not tensors:
        return tensors
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    out, offset = [], 0
    for t in tensors:
        out.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


class DPDDPStrategy(DPStrategyMixin, DDPStrategy):
    """Differentially private DDP: ``Trainer(strategy="dp_ddp", devices=N, num_nodes=M)``.

    Takes the privacy arguments of :class:`~lightning_dp.DPStrategy`. The train DataLoader's
    ``batch_size`` is the expected *logical* batch over all devices (q = batch_size / N), so the same
    config gives the same q, steps and ε on any number of devices, and each rank draws about
    batch_size / world_size examples a step. ``per_device_batch_size=True`` gives Lightning's
    per-device meaning instead (logical batch = batch_size × world size).
    ``process_group_backend`` defaults to NCCL on GPUs and gloo on CPU.
    """

    strategy_name = "dp_ddp"

    def __init__(
        self,
        target_epsilon: float | None = None,
        delta: float = 1e-5,
        max_grad_norm: float = 1.0,
        noise_multiplier: float | None = None,
        accountant: Literal["rdp", "prv", "pld"] = "rdp",
        sampler: Sampler | None = None,
        clipping: Clipping | None = None,
        noise: Noise | None = None,
        step: Step | None = None,
        on_batchnorm: OnBatchNorm = "raise",
        loss_reduction: Literal["mean", "sum"] = "mean",
        seed: int | None = None,
        per_device_batch_size: bool = False,
        max_physical_batch_size: int | None = None,
        grad_sample_mode: GradMode = "auto",
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        DDPStrategy.__init__(
            self,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            start_method=start_method,
            **kwargs,
        )
        self._init_dp(
            target_epsilon=target_epsilon,
            delta=delta,
            max_grad_norm=max_grad_norm,
            noise_multiplier=noise_multiplier,
            accountant=accountant,
            sampler=sampler,
            clipping=clipping,
            noise=noise,
            step=step,
            on_batchnorm=on_batchnorm,
            loss_reduction=loss_reduction,
            seed=seed,
            max_physical_batch_size=max_physical_batch_size,
            grad_sample_mode=grad_sample_mode,
        )
        self.per_device_batch_size = per_device_batch_size

    def setup(self, trainer: Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self.engine.rank, self.engine.world_size = self.global_rank, self.world_size
            self.engine.all_reduce = all_reduce_sum if self.world_size > 1 else None
        super().setup(trainer)

    def configure_ddp(self) -> None:
        """No DistributedDataParallel wrapper: only start every rank from rank 0's weights."""
        assert self.model is not None
        _sync_module_states(self.model)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="DP-SGD on Lightning's DDP (lightning-dp)", override=True
        )
