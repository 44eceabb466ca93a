"""DPFSDPStrategy: DP-SGD on parameters sharded with FSDP2 (``fully_shard``), on Lightning's ModelParallelStrategy.

Every rank keeps only its shard of each parameter, of its gradient and of the optimizer state, and during
the step it holds in full only the FSDP2 units its forward or backward is in (FSDP2's own per-unit
all-gather and reshard). A step runs in four moves:

1. every rank makes the same passes (:mod:`~lightning_dp.strategies.lockstep`): the ranks agree on the
   number of physical chunks, a rank with fewer (an empty Poisson batch has none) runs zero-contributing
   placeholder passes, and the run-time checks' dry passes are answered pass for pass by the other ranks;
2. each rank computes the per-example gradients of its own examples from their activations and output
   gradients (never the unsharded weight) and clips them, as under ``dp_ddp``;
3. the clipped sum is formed one FSDP2 unit at a time, and each unit's is reduce-scattered at once with an
   explicit SUM (FSDP2's own AVG is not used: on gloo it sums, pytorch #162338): each rank keeps the sum
   over all ranks of the rows it owns, never the whole model's full-size sum; under virtual batching each
   chunk's sum is reduce-scattered as it is formed, and the shards add up;
4. each rank adds noise of std σC to its rows only, from its own generator (each coordinate noised once,
   by its owner), the gradient is divided by the public expected batch size and the user's optimizer
   steps the local shards.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
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
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from typing_extensions import override

from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.engine import PrivateStepEngine
from lightning_dp.slots import Clipping, Step
from lightning_dp.strategies.base import DPStrategyBase
from lightning_dp.strategies.checkpoints import CHECKPOINT_KEY, _rank_dp_state, gather_dp_state
from lightning_dp.strategies.config import PrivacyConfig, takes_privacy_options
from lightning_dp.strategies.ddp import all_reduce_sum, ranks_agree, refuse_on_every_rank
from lightning_dp.strategies.lockstep import Lockstep
from lightning_dp.strategies.optim import DPOptimizer
from lightning_dp.strategies.refusals import refuse_laplace_shares

_IDLE = TrainingState.IDLE


class ShardedParameters:
    """The FSDP2 parameters of a model: the full-size stand-ins the hooks key by, and the sharded release.

    FSDP2 registers on each layer a sharded DTensor (what the optimizer holds) at rest and, while its unit
    is unsharded (FSDP2's per-unit all-gather in forward and backward), a full plain tensor
    (``FSDPParam._unsharded_param``, one object for the whole run, its storage freed when resharded).
    lightning-dp's per-example hooks key everything by those full tensors (:meth:`stand_in` lets them
    attach without gathering the model); the clipped sum is reduce-scattered one unit at a time as it is
    formed (:meth:`groups`, :meth:`take`: the engine's sum sink), and each rank's shard becomes the
    sharded parameter's gradient (:meth:`assign`). Reads FSDP2's ``FSDPParam`` (torch 2.14).
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
        inside = {id(c) for m in self.modules for c in m.modules() if c is not m}
        self.roots = [m for m in self.modules if id(m) not in inside]
        """The outermost sharded modules (their forward is a pass's)."""
        self.groups_ = [g for m in self.modules for g in m._get_fsdp_state()._fsdp_param_groups]
        self.fsdp_params = [fp for g in self.groups_ for fp in g.fsdp_params]
        for module in self.modules:
            module.set_requires_gradient_sync(False, recurse=False)  # FSDP2 never reduces it either
        self.standing_in = False
        self._owner: dict[int, Any] = {}
        self._unit: dict[int, int] = {}
        self.formed = False
        """Whether the sums of this release were reduce-scattered as they were formed (:meth:`take`)."""

    def compute_precision(self) -> str | None:
        """ "bf16-mixed" or "16-mixed" when a MixedPrecisionPolicy casts the parameters the forward uses
        (the run-time checks' rounding allowance follows the dtype the forward computes in), else None."""
        dtypes = {g.mp_policy.param_dtype for g in self.groups_ if g.mp_policy.param_dtype is not None}
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

    # -- set-up: the hooks attach to the full-size tensors, none of them gathered --------------------------
    def stand_in(self) -> None:
        """Register FSDP2's full-size parameter objects on the layers, without their storage, while
        lightning-dp attaches its hooks (which key by them): each unit is gathered and resharded once, one
        after another (FSDP2 creates the objects at its first all-gather), so no more than one unit is full."""
        if self.standing_in:
            return
        for module in self.modules:  # outermost first: its FSDP2 state becomes the root
            module.unshard()
            module.reshard()
        for fp in self.fsdp_params:  # after FSDP2's lazy init, which sets it
            fp.reduce_dtype = None  # the non-private gradient stays where autograd put it (never reduced)
        for (
            group
        ) in self.groups_:  # registered and marked unsharded (FSDP2's own reshard undoes it); no storage
            group._to_unsharded()
        self._owner = {id(fp._unsharded_param): fp for fp in self.fsdp_params}
        self._unit = {id(fp._unsharded_param): i for i, g in enumerate(self.groups_) for fp in g.fsdp_params}
        self.standing_in = True

    def stand_down(self) -> None:
        """The sharded parameters are registered again (what configure_optimizers and checkpoints see)."""
        if not self.standing_in:
            return
        for module in self.modules:
            module.reshard()
        self.standing_in = False

    @contextmanager
    def registered(self) -> Iterator[None]:
        """The layers hold the full-size parameter objects (storage freed or not) for the block: the
        per-example kernels, run after a unit's backward resharded it, key their results by the layer's
        parameters, which must be the ones the hooks recorded. Only attributes change; FSDP2's state does not."""
        slots = [
            (module, name, fp._unsharded_param)
            for fp in self.fsdp_params
            if hasattr(fp, "_unsharded_param")
            for module, name in [
                (fp._module_info.module, fp._module_info.param_name),
                *zip(fp._module_info.shared_modules, fp._module_info.shared_param_names, strict=True),
            ]
        ]
        saved = [module._parameters[name] for module, name, _ in slots]
        for module, name, full in slots:
            module._parameters[name] = full
        try:
            yield
        finally:
            for (module, name, _), before in zip(slots, saved, strict=True):
                module._parameters[name] = before

    # -- between passes ----------------------------------------------------------------------------------------
    def settle(self) -> None:
        """Reshard every unit a pass left gathered (FSDP2 keeps the root unit gathered after a forward
        without backward), so that every rank starts its next pass with the same collectives."""
        for group in self.groups_:
            if group.is_unsharded and group._training_state == _IDLE:
                group.reshard()

    def forget_grads(self) -> None:
        """Drop the full-size non-private gradients a dry or placeholder pass left (before the consistency
        check's first step, autograd still computes them)."""
        for fp in self.fsdp_params:
            if hasattr(fp, "_unsharded_param"):
                fp._unsharded_param.grad = None
            fp.unsharded_accumulated_grad = None

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

    # -- the engine's sum sink: one reduce-scatter per FSDP2 unit, as its sums are formed --------------------
    def groups(self, params: Sequence[nn.Parameter]) -> list[list[nn.Parameter]]:
        """``params`` per FSDP2 unit, in the units' order (the same on every rank)."""
        parts: list[list[nn.Parameter]] = [[] for _ in self.groups_]
        for p in params:
            self._param(p)
            parts[self._unit[id(p)]].append(p)
        return [part for part in parts if part]

    def take(self, params: list[nn.Parameter], sums: list[Tensor]) -> list[Tensor]:
        """One unit's full-size sums → this rank's shards of their sum over all ranks."""
        self.formed = True
        return self.reduce_scatter(params, sums)

    def to_shards(self, params: list[nn.Parameter], sums: list[Tensor]) -> list[Tensor]:
        """The release's sums as this rank's shards: already so when formed through :meth:`take`; else (a
        clipping that built its sums itself) reduce-scattered now."""
        if len(sums) != len(params):
            raise DPConfigurationError(
                "A release hook added tensors to the clipped sums (a privacy audit's canaries): under "
                "strategy='dp_fsdp' each rank keeps only its shard of the parameters' sums, so extra tensors "
                "have no owner. Run the audit with strategy='dp_ddp' or on one device."
            )
        if not self.formed:
            return self.reduce_scatter(params, sums)
        self.formed = False
        for p, s in zip(params, sums, strict=True):
            if s.shape != self._param(p).sharded_size:
                raise RuntimeError(
                    "A clipping slot mixed sums reduce-scattered as they were formed with sums it built "
                    "itself: under strategy='dp_fsdp' take every sum through grad_samples.weighted_sum."
                )
        return list(sums)

    def reduce_scatter(self, params: list[nn.Parameter], sums: list[Tensor]) -> list[Tensor]:
        """Σ over ranks of each full-shape local sum, each rank getting only its rows: one reduce-scatter (SUM)."""
        dtype = functools.reduce(torch.promote_types, [s.dtype for s in sums], torch.float32)
        blocks = []
        for p, s in zip(params, sums, strict=True):
            per_rank, _ = self._rows(self._param(p))
            rows = s.reshape(s.shape[0], -1) if s.dim() else s.reshape(1, 1)
            padded = torch.zeros(per_rank * self.world_size, rows.shape[1], device=s.device, dtype=dtype)
            padded[: rows.shape[0]] = rows
            blocks.append(padded.view(self.world_size, -1))
        widths = [block.shape[1] for block in blocks]
        flat = torch.cat(blocks, dim=1)
        del blocks
        out = torch.empty(flat.shape[1], device=flat.device, dtype=dtype)
        dist.reduce_scatter_tensor(out, flat.reshape(-1), op=dist.ReduceOp.SUM)
        shards, offset = [], 0
        for p, width in zip(params, widths, strict=True):
            fp = self._param(p)
            per_rank, owned = self._rows(fp)
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

    Every privacy option of :class:`~lightning_dp.strategies.PrivacyConfig` is taken by keyword, as by
    :class:`~lightning_dp.DPStrategy`.
    """

    strategy_name = "dp_fsdp"

    @takes_privacy_options
    def __init__(
        self,
        *,
        per_device_batch_size: bool = False,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **options: Any,
    ) -> None:
        config = PrivacyConfig.from_options(options, owner=type(self).__name__)
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
        self.lockstep: Lockstep | None = None

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
        self.shards = shards = ShardedParameters(self.model, self.world_size, self.global_rank)
        shards.refuse_unsharded(self.model)
        compute = shards.compute_precision()
        if compute is not None and "true" in str(self.precision_plugin.precision):
            self.precision_plugin.precision = compute  # type: ignore[assignment]
        self.engine.use_sinks(shards, shards, lambda sums: shards.to_shards(self.engine.params, sums))
        shards.stand_in()  # the hooks key by the full-size tensors the forward uses (until setup_optimizers)
        super().setup(trainer)
        self.engine.use_registered(shards.registered)
        self.lockstep = Lockstep(
            self._module(), shards.roots, shards.settle, shards.forget_grads, capture=lambda: self.engine.grads,
            placeholder=self._placeholder, precision=self.precision_plugin, device=self.root_device,
            collectives=self._step_collectives(),
        )  # fmt: skip
        # also on one process: each pass ends with every unit resharded
        self._install_placeholders(self.lockstep)

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        if self.shards is not None:
            self.shards.stand_down()  # configure_optimizers sees the sharded parameters
        super().setup_optimizers(trainer)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        lockstep = self.lockstep
        if lockstep is None or not self._fitting() or not self._module().automatic_optimization:
            return output
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if isinstance(loss, Tensor) or self.engine.halted:  # halted: no rank releases anything
            return output
        # No loss: the pass ends now with a backward of zeros (as the other ranks' backward of their loss),
        # and the step goes on through post_backward like theirs, releasing noise alone for this rank's share
        # (what a step without loss releases on one process). No collective decides it.
        lockstep.close()
        grads = self.engine.grads
        if grads is not None:
            grads.discard()
        assert self.shards is not None
        self.shards.forget_grads()
        return torch.zeros((), device=self.root_device, requires_grad=True)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        if self.lockstep is not None:
            self.lockstep.close()  # a loss that reached no model output: its backward's collectives now
        super().post_backward(closure_loss)

    @override
    def _refuse_together(self, check: Callable[[], None], passes: bool = True) -> None:
        lockstep = self.lockstep

        def in_step() -> None:
            if lockstep is None or not passes:
                check()
                return
            with lockstep.window():  # a check's dry passes: every rank answers them (and their gradients go)
                check()

        refuse_on_every_rank(self, in_step)

    @override
    def _check_ranks_agree(self, fields: dict[str, Any]) -> None:
        ranks_agree(self, fields)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
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
        if self.lockstep is not None:
            self.lockstep.remove()
        if self.shards is not None:
            self.shards.stand_down()
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
