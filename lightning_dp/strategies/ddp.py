"""DPDDPStrategy: DP-SGD across processes, GPUs and nodes on Lightning's own DDP machinery.

Each rank computes per-example gradients of its own share of the Poisson batch and clips them; each
adds an independent noise share σC/√W from its own generator; one all-reduce of the noisy clipped
sums gives every rank the same private gradient. No torch DDP reducer runs on the non-private
gradient (the model is not wrapped), so there is exactly one collective per step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.slots import Slot, iter_slots
from lightning_dp.strategies.base import DPStrategyBase
from lightning_dp.strategies.config import PrivacyConfig, takes_privacy_options
from lightning_dp.strategies.refusals import refuse_laplace_shares


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


_SCALARS = (bool, int, float, str, type(None))


def slot_settings(slot: Slot) -> dict[str, Any]:
    """A slot's name and its public scalar settings, a settings or state dataclass's fields by their dotted
    name (``config.beta``, ``state.eta0`` of LineSearch); per-rank ones, such as its rank, left out."""
    items: dict[str, Any] = {}
    for key, value in vars(slot).items():
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            items.update({f"{key}.{f.name}": getattr(value, f.name) for f in dataclasses.fields(value)})
        else:
            items[key] = value
    settings = {
        key: value
        for key, value in items.items()
        if not key.startswith("_") and "rank" not in key and isinstance(value, _SCALARS)
    }
    return {"name": slot.name, **settings}


def find_disagreement(per_rank: list[dict[str, Any]]) -> tuple[int, str, Any, Any] | None:
    """The first (rank, field, its value, rank 0's value) where a rank differs from rank 0, else None.

    Values are compared by ``repr`` so that NaN settings agree with themselves."""
    reference = per_rank[0]
    for rank, fields in enumerate(per_rank[1:], start=1):
        for field in sorted(reference.keys() | fields.keys()):
            ours, theirs = reference.get(field), fields.get(field)
            if repr(ours) != repr(theirs):
                return rank, field, theirs, ours
    return None


def check_ranks_agree(fields: dict[str, Any], world_size: int) -> None:
    """Gather ``fields`` from every rank and refuse the run on any difference (raised on every rank).

    One privacy guarantee covers the run only if every rank samples with the same q from the same N
    and adds the same noise: rank 0 writes the report, so a rank that differs would go unpriced."""
    per_rank: list[Any] = [None] * world_size
    dist.all_gather_object(per_rank, fields)
    found = find_disagreement(per_rank)
    if found is None:
        return
    rank, field, theirs, ours = found
    raise DPConfigurationError(
        f"The ranks disagree on the privacy setting {field!r}: rank {rank} has {theirs!r}, rank 0 has {ours!r}. "
        "Rank 0's ledger and report price one run with rank 0's settings, so a rank that samples or adds noise "
        "differently is not covered. Give every rank the same data set (the same N), batch size, strategy "
        "arguments and slots."
    )


def refuse_together(check: Callable[[], None], device: torch.device) -> None:
    """Run ``check`` on every rank; if it refuses on any, every rank raises (a rank that went on would
    wait forever in the next all-reduce). One small all-reduce when all pass; messages gathered only on a
    refusal."""
    error: DPConfigurationError | None = None
    try:
        check()
    except DPConfigurationError as raised:
        error = raised
    flag = torch.tensor([0.0 if error is None else 1.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if float(flag) == 0:
        return
    messages: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else str(error))
    if error is not None:
        raise error
    rank, message = next((r, m) for r, m in enumerate(messages) if m is not None)
    raise DPConfigurationError(f"Rank {rank} refused this step before its release: {message}")


def distributed(strategy: DPStrategyBase) -> bool:
    """Whether the strategy runs on several processes with a process group up (else nothing to agree)."""
    return strategy.world_size > 1 and dist.is_available() and dist.is_initialized()


def refuse_on_every_rank(strategy: DPStrategyBase, check: Callable[[], None]) -> None:
    """``check``, and on several processes every rank refuses if one does (:func:`refuse_together`)."""
    if not distributed(strategy):
        check()
        return
    refuse_together(check, strategy.root_device)


def ranks_agree(strategy: DPStrategyBase, fields: dict[str, Any]) -> None:
    """On several processes, refuse a run whose ranks differ on ``fields`` or on :func:`rank_agreement`."""
    if distributed(strategy):
        check_ranks_agree({**fields, **rank_agreement(strategy)}, strategy.world_size)


def rank_agreement(strategy: DPStrategyBase) -> dict[str, Any]:
    """What every rank of a distributed strategy must share to price one run: δ, the target, C, the
    batch-size meaning, the data settings and every slot's public settings."""
    engine = strategy.engine
    common: dict[str, Any] = {
        key: getattr(engine, key)
        for key in ("target_epsilon", "delta", "max_grad_norm", "accountant", "loss_reduction")
    }
    common.update(per_device_batch_size=strategy.per_device_batch_size)
    config = strategy.config
    common.update(
        data_changes=config.checks.data_changes, augmentation_multiplicity=config.augmentation_multiplicity
    )
    for name, slot in iter_slots(engine.sampler, engine.clipping, engine.noise, engine.step_slot):
        common.update({f"{name}.{key}": value for key, value in slot_settings(slot).items()})
    return common


class DPDDPStrategy(DPStrategyBase, DDPStrategy):
    """Differentially private DDP: ``Trainer(strategy="dp_ddp", devices=N, num_nodes=M)``.

    Takes every privacy option of :class:`~lightning_dp.strategies.PrivacyConfig` by keyword, as
    :class:`~lightning_dp.DPStrategy` does (``accountant="pure"`` is refused at set-up on several
    processes: Laplace shares do not sum to Laplace noise). The train DataLoader's
    ``batch_size`` is the expected *logical* batch over all devices (q = batch_size / N), so the same
    config gives the same q, steps and ε on any number of devices, and each rank draws about
    batch_size / world_size examples a step. ``per_device_batch_size=True`` gives Lightning's
    per-device meaning instead (logical batch = batch_size × world size).
    ``process_group_backend`` defaults to NCCL on GPUs and gloo on CPU.

    Args:
        per_device_batch_size: read the DataLoader's ``batch_size`` as examples per device (Lightning's
            meaning: logical batch = batch_size × world size) instead of the logical batch over all
            devices (default False).
        process_group_backend: the torch.distributed backend (default None: NCCL on GPUs, gloo on CPU).
        timeout: how long a collective may wait before it fails (default None: torch's default).
        start_method: how Lightning starts the processes: ``"popen"`` (default), ``"spawn"``, ``"fork"`` or
            ``"forkserver"``.

    ``accelerator``, ``parallel_devices``, ``cluster_environment``, ``checkpoint_io`` and
    ``precision_plugin`` are Lightning's.
    """

    strategy_name = "dp_ddp"

    @takes_privacy_options
    def __init__(
        self,
        *,
        per_device_batch_size: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        **options: Any,
    ) -> None:
        config = PrivacyConfig.from_options(options, owner=type(self).__name__)
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
        self._init_dp(config)
        self.per_device_batch_size = per_device_batch_size

    @override
    def setup(self, trainer: Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            refuse_laplace_shares(self.engine.accountant, self.world_size)
            self.engine.connect(
                self.global_rank, self.world_size, all_reduce_sum if self.world_size > 1 else None
            )
        super().setup(trainer)

    @override
    def _refuse_together(self, check: Callable[[], None]) -> None:
        refuse_on_every_rank(self, check)

    @override
    def _check_ranks_agree(self, fields: dict[str, Any]) -> None:
        """Every rank must price the same run: the given fields, δ, the target, C and the slots."""
        ranks_agree(self, fields)

    @override
    def configure_ddp(self) -> None:
        """No DistributedDataParallel wrapper: only start every rank from rank 0's weights."""
        assert self.model is not None
        _sync_module_states(self.model)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="DP-SGD on Lightning's DDP (lightning-dp)", override=True
        )
