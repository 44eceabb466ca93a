"""DPFSDPStrategy: DP-SGD on parameters sharded with FSDP2 (``fully_shard``), on Lightning's ModelParallelStrategy.

Every rank keeps only its shard of each parameter, of its gradient and of the optimizer state between
steps. A step runs in four moves:

1. the parameters are all-gathered once (FSDP2's ``unshard``), so the step's forwards and backwards make no
   collective: per-rank Poisson batches give the ranks different work (an empty batch, more physical
   chunks, the sensitivity check's extra passes), which FSDP2's per-layer collectives would deadlock on;
2. each rank computes the per-example gradients of its own examples from their activations and output
   gradients (never the unsharded weight) and clips them, as under ``dp_ddp``;
3. one reduce-scatter with an explicit SUM gives each rank the sum over all ranks of the rows it owns
   (FSDP2's own AVG is not used: on gloo it sums, pytorch #162338), and each rank adds noise of std σC to
   those rows only, from its own generator: each coordinate is noised once, by its owner;
4. the gathered parameters are freed, the gradient is divided by the public expected batch size and the
   user's optimizer steps the local shards.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from typing_extensions import override

from lightning_dp.engine import PrivateStepEngine
from lightning_dp.errors import DPConfigurationError
from lightning_dp.slots import Clipping, Step
from lightning_dp.strategies.base import DPStrategyBase
from lightning_dp.strategies.checkpoints import CHECKPOINT_KEY, _rank_dp_state, gather_dp_state
from lightning_dp.strategies.config import PrivacyConfig
from lightning_dp.strategies.ddp import all_reduce_sum, check_ranks_agree, rank_agreement, refuse_together
from lightning_dp.strategies.optim import DPOptimizer
from lightning_dp.strategies.refusals import refuse_laplace_shares


class ShardedParameters:
    """The FSDP2 parameters of a model: gathered for a step, each rank's gradient shard, one reduce-scatter.

    FSDP2 registers on each layer a sharded DTensor (what the optimizer holds) at rest and, while the
    layer is unsharded, a full plain tensor (``FSDPParam._unsharded_param``, one object for the whole run).
    lightning-dp's per-example hooks key everything by the full tensors the forward uses, so all of
    lightning-dp's work on the module happens between :meth:`gather` and :meth:`release`; the released
    gradient goes to the sharded parameter (:meth:`assign`). Reads FSDP2's ``FSDPParam`` (torch 2.14).
    """

    def __init__(self, model: nn.Module, world_size: int, rank: int) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.world_size, self.rank = world_size, rank
        self.modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        if not self.modules:
            raise DPConfigurationError(
                "strategy='dp_fsdp' found no module sharded with fully_shard: the model would be replicated, "
                "not sharded. In the LightningModule's configure_model(), call "
                "torch.distributed.fsdp.fully_shard on each block and then on the module that holds them "
                "(see docs/multi-gpu.md), or use strategy='dp_ddp' for a model that fits on one device."
            )
        self.groups = [g for m in self.modules for g in m._get_fsdp_state()._fsdp_param_groups]
        self.fsdp_params = [fp for g in self.groups for fp in g.fsdp_params]
        for module in self.modules:
            module.set_requires_gradient_sync(False, recurse=False)  # FSDP2 never reduces it either
        self.gathered = False
        self._owner: dict[int, Any] = {}
        self._saved: list[tuple[Any, Any, bool]] = []

    def compute_precision(self) -> str | None:
        """ "bf16-mixed" or "16-mixed" when a MixedPrecisionPolicy casts the parameters the forward uses
        (the run-time checks' rounding allowance follows the dtype the forward computes in), else None."""
        dtypes = {g.mp_policy.param_dtype for g in self.groups if g.mp_policy.param_dtype is not None}
        if torch.float16 in dtypes:
            return "16-mixed"
        return "bf16-mixed" if torch.bfloat16 in dtypes else None

    def refuse_unsharded(self, model: nn.Module) -> None:
        """Every trainable parameter must be an FSDP2 shard on dimension 0 (each coordinate one owner)."""
        managed = {id(fp.sharded_param) for fp in self.fsdp_params}
        names = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in managed]
        if names:
            raise DPConfigurationError(
                f"The trainable parameters {names[:8]} are not sharded by fully_shard: under strategy='dp_fsdp' "
                "each rank noises only the rows it owns, so a replicated parameter would get no noise on some "
                "ranks. Call fully_shard on the module that holds them too (last on the module that holds "
                "every block), or freeze them."
            )
        for fp in self.fsdp_params:
            if fp.fsdp_placement.dim != 0 or fp.is_dtensor:
                raise DPConfigurationError(
                    f"The parameter {fp._module_info.param_name!r} is sharded on dimension "
                    f"{fp.fsdp_placement.dim} or also tensor-parallel: strategy='dp_fsdp' reduce-scatters "
                    "the clipped sum along dimension 0 of plain (not tensor-parallel) parameters. Call "
                    "fully_shard without shard_placement_fn and without tensor parallelism."
                )

    # -- the step's window: full parameters on every layer ----------------------------------------------
    def gather(self) -> None:
        """All-gather every parameter (every rank, the same modules in the same order) and keep it gathered
        through the step's forwards and backwards; idempotent."""
        if self.gathered:
            return
        self._saved = [(g, g.post_forward_mesh_info, g.reshard_after_backward) for g in self.groups]
        for group in self.groups:
            group.post_forward_mesh_info = None  # no reshard after forward or backward: no collective
            group.reshard_after_backward = False
        for module in self.modules:
            module.unshard()
        for fp in self.fsdp_params:  # after FSDP2's lazy init, which sets it
            fp.reduce_dtype = None  # the non-private gradient stays where autograd put it (never reduced)
        self._owner = {id(fp._unsharded_param): fp for fp in self.fsdp_params}
        self.gathered = True

    def release(self) -> None:
        """Free the gathered parameters (the sharded ones are registered again) and restore FSDP2's settings."""
        if not self.gathered:
            return
        for fp in self.fsdp_params:  # the non-private gradient of a check's pass, or of the first step
            fp._unsharded_param.grad = None
        for module in self.modules:
            module.reshard()
        for group, mesh_info, after_backward in self._saved:
            group.post_forward_mesh_info, group.reshard_after_backward = mesh_info, after_backward
        self.gathered = False

    @contextmanager
    def gathering(self) -> Iterator[None]:
        self.gather()
        try:
            yield
        finally:
            self.release()

    # -- the engine's gradient sink ------------------------------------------------------------------------
    def _param(self, standin: Tensor) -> Any:
        found = self._owner.get(id(standin))
        if found is None:
            raise RuntimeError(
                "lightning-dp's hooks hold a parameter FSDP2 no longer manages (was fully_shard called again?)."
            )
        return found

    def stepped(self, param: nn.Parameter) -> nn.Parameter:
        """The parameter the optimizer holds for the gathered one the hooks see: its sharded DTensor."""
        return self._param(param).sharded_param

    def _rows(self, fp: Any) -> tuple[int, int]:
        """(rows per rank after padding, rows this rank owns) of a parameter sharded on dimension 0."""
        full = fp._orig_size[0]
        per_rank = math.ceil(full / self.world_size)
        return per_rank, max(0, min(per_rank, full - self.rank * per_rank))

    def reduce_scatter(self, params: list[nn.Parameter], sums: list[Tensor]) -> list[Tensor]:
        """Σ over ranks of each full-shape local sum, each rank getting only its rows: one reduce-scatter (SUM)."""
        if len(sums) != len(params):
            raise DPConfigurationError(
                "A release hook added tensors to the clipped sums (a privacy audit's canaries): under "
                "strategy='dp_fsdp' each rank keeps only its shard of the parameters' sums, so extra tensors "
                "have no owner. Run the audit with strategy='dp_ddp' or on one device."
            )
        dtype = functools.reduce(torch.promote_types, [s.dtype for s in sums], torch.float32)
        blocks = []
        for p, s in zip(params, sums, strict=True):
            per_rank, _ = self._rows(self._param(p))
            rows = s.reshape(s.shape[0], -1) if s.dim() else s.reshape(1, 1)
            padded = torch.zeros(per_rank * self.world_size, rows.shape[1], device=s.device, dtype=dtype)
            padded[: rows.shape[0]] = rows
            blocks.append(padded.view(self.world_size, -1))
        flat = torch.cat(blocks, dim=1)
        out = torch.empty(flat.shape[1], device=flat.device, dtype=dtype)
        dist.reduce_scatter_tensor(out, flat.reshape(-1), op=dist.ReduceOp.SUM)
        shards, offset = [], 0
        for p, block in zip(params, blocks, strict=True):
            fp = self._param(p)
            per_rank, owned = self._rows(fp)
            width = block.shape[1]
            local = out[offset : offset + width].view(per_rank, -1)[:owned]
            shards.append(local.reshape(fp.sharded_size))
            offset += width
        return shards

    def assign(self, params: list[nn.Parameter], grads: list[Tensor]) -> None:
        """Each rank's released shard becomes the sharded parameter's gradient (what the optimizer steps)."""
        for p, g in zip(params, grads, strict=True):
            fp = self._param(p)
            p.grad = None
            fp.sharded_param.grad = fp.to_sharded_dtensor(g.to(fp.sharded_param.dtype).contiguous())


def _unwrapped(optimizer: Any) -> Any:
    """The user's optimizer behind Lightning's wrapper and lightning-dp's proxy."""
    inner = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
    return inner.original_optimizer if isinstance(inner, DPOptimizer) else inner


def refuse_unsharded_slots(engine: PrivateStepEngine) -> None:
    """The slots whose state, post-processing or passes need the full parameters, which a rank holding one
    shard lacks, or every rank in lock step outside the training steps."""
    owner, step, clipping = "DPFSDPStrategy", engine.step_slot, engine.clipping
    if type(step) is not Step:
        raise DPConfigurationError(
            f"{owner}: step={step.name} keeps state per parameter or releases more than the gradient, over the "
            "full parameters; under strategy='dp_fsdp' each rank holds only its shard. Use the default step "
            "(the user's optimizer) with dp_fsdp, or train with strategy='dp_ddp'."
        )
    if type(clipping).finalize is not Clipping.finalize:
        raise DPConfigurationError(
            f"{owner}: clipping={clipping.name} post-processes the released sum per coordinate with state of the "
            "full parameters; under strategy='dp_fsdp' each rank holds only its shard. Use FlatClipping with "
            "dp_fsdp, or train with strategy='dp_ddp'."
        )
    if engine.noise.correlated:
        raise DPConfigurationError(
            f"{owner}: noise={engine.noise.name} correlates the noise across steps with state of the full "
            "parameters, which a rank holding one shard does not have. Use independent noise "
            "(noise_multiplier=... or ConstantNoise) with dp_fsdp, or train with strategy='dp_ddp'."
        )
    if engine.sampler.schedules_noise:
        raise DPConfigurationError(
            f"{owner}: sampler={engine.sampler.name} runs a pass over the data outside the training steps, "
            "which under strategy='dp_fsdp' would need every rank in lock step. Use Poisson or user-level "
            "sampling with dp_fsdp, or train with strategy='dp_ddp'."
        )


class DPFSDPStrategy(DPStrategyBase, ModelParallelStrategy):
    """Differentially private FSDP2: ``Trainer(strategy="dp_fsdp", devices=N)``, parameters sharded over N ranks.

    The LightningModule shards itself in ``configure_model()`` with ``torch.distributed.fsdp.fully_shard``
    (Lightning's own rule for ``ModelParallelStrategy``); every rank is a data-parallel rank (no tensor
    parallelism). The privacy semantics are ``dp_ddp``'s: per-rank Poisson sampling whose union is one
    Poisson sample, per-example clipping of each rank's examples, one noise draw of σC per coordinate, one
    ledger, the same ε as one process for the same q, σ and steps.

    Args:
        per_device_batch_size: as for :class:`~lightning_dp.DPDDPStrategy` (default False: the DataLoader's
            ``batch_size`` is the expected logical batch over all devices).
        save_distributed_checkpoint: each rank saves its shards to a checkpoint folder (torch distributed
            checkpoint; default True), else rank 0 saves the full weights to one file.
        process_group_backend: the torch.distributed backend (default: NCCL on GPUs, gloo on CPU).
        timeout: how long a collective may wait before it fails.
        **privacy: the privacy arguments of :class:`~lightning_dp.DPStrategy`
            (:class:`~lightning_dp.strategies.PrivacyConfig`), with the same meaning, default and unit.
    """

    strategy_name = "dp_fsdp"

    def __init__(
        self,
        per_device_batch_size: bool = False,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **privacy: Any,
    ) -> None:
        config = PrivacyConfig(**privacy, owner=type(self).__name__)
        ModelParallelStrategy.__init__(
            self,
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._init_dp(config)
        refuse_unsharded_slots(self.engine)
        self.per_device_batch_size = per_device_batch_size
        self.shards: ShardedParameters | None = None

    @override
    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # every rank is a data-parallel rank
        super().setup_environment()

    @override
    def setup(self, trainer: Trainer) -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            super().setup(trainer)
            return
        refuse_laplace_shares(self.engine.accountant, self.world_size)
        self.engine.connect(
            self.global_rank, self.world_size, all_reduce_sum if self.world_size > 1 else None
        )
        assert self.model is not None
        _materialize_distributed_module(self.model, self.root_device)  # hooks go on the real parameters
        self.shards = ShardedParameters(self.model, self.world_size, self.global_rank)
        self.shards.refuse_unsharded(self.model)
        compute = self.shards.compute_precision()
        if compute is not None and "true" in str(self.precision_plugin.precision):
            self.precision_plugin.precision = compute  # type: ignore[assignment]
        shards = self.shards
        self.engine.gradient_sink = shards
        self.engine.releases.reduce_scatter_fn = lambda sums: shards.reduce_scatter(self.engine.params, sums)
        with shards.gathering():  # the hooks key by the full parameters the forward uses
            super().setup(trainer)

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        if self.shards is not None:
            self.shards.release()  # configure_optimizers sees the sharded parameters
        super().setup_optimizers(trainer)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.shards is not None and self._fitting():
            self.shards.gather()
            if self.checks.state is not None:  # the gathered tensors stand for the parameters the step saw
                self.checks.state.at_entry()
        return super().training_step(*args, **kwargs)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        super().post_backward(closure_loss)
        if self.shards is not None and self.engine.pending_ctx is not None:
            self.shards.release()  # released: the hooks after backward see the sharded parameters' gradients

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        try:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            if self.shards is not None:
                self.shards.release()

    @override
    def _refuse_together(self, check: Callable[[], None]) -> None:
        if self.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
            check()
            return
        refuse_together(check, self.root_device)

    @override
    def _check_ranks_agree(self, fields: dict[str, Any]) -> None:
        if self.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
            return
        check_ranks_agree({**fields, **rank_agreement(self)}, self.world_size)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if self.shards is not None:
            self.shards.release()
        checkpoint[CHECKPOINT_KEY] = gather_dp_state(self.engine, self.world_size, self.step_counts)
        ModelParallelStrategy.save_checkpoint(self, checkpoint, filepath, storage_options=storage_options)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        # torch's state-dict helpers step an optimizer whose state is empty (lr set to 0) to build it: that
        # must be the user's optimizer, never the proxy, whose step is a private release
        return super().optimizer_state(_unwrapped(optimizer))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        meta = Path(checkpoint_path) / _METADATA_FILENAME
        if self._fitting() and meta.is_file():  # a sharded checkpoint of another world size: refused by name
            state = torch.load(meta, weights_only=True).get(CHECKPOINT_KEY)  # before its shards are read
            if state is not None:
                _rank_dp_state(state, self.world_size, self.global_rank)
        wrapped, self.optimizers = self.optimizers, [_unwrapped(o) for o in self.optimizers]
        try:  # ModelParallelStrategy loads the shards into the user's optimizers (see optimizer_state)
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        finally:
            self.optimizers = wrapped

    @override
    def teardown(self) -> None:
        if self.shards is not None:
            self.shards.release()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="DP-SGD on FSDP2-sharded parameters (lightning-dp)",
            override=True,
        )
