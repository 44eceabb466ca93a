"""DPStrategyBase: the Lightning hooks of a private run, in the order Lightning calls them.

Each hook is a short checklist; the work is in the modules beside this one:

1. ``setup``              refuse settings that break privacy (refusals); fix the module in place; attach hooks
2. ``setup_optimizers``   wrap the user's optimizer so the step slot moves the weights (optim)
3. ``load_checkpoint``    restore the ledger, the slots and the RNG streams, after set-up (checkpoints)
4. ``process_dataloader`` swap the train loader for the sampler slot's batches; calibrate σ (loaders)
5. ``training_step``      an empty batch never reaches user code: it becomes a noise-only step (routing);
                          distributed: every rank makes as many training_step calls, a rank with fewer
                          making placeholder calls, and user code's collectives meet (lockstep, collectives)
6. ``post_backward``      clip, price in the ledger, add noise: every later hook sees private grads
7. ``save_checkpoint``    store the privacy state next to the weights (checkpoints)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_dp.accounting import BudgetExceededError, PrivacyLedger
from lightning_dp.checks import RunChecks
from lightning_dp.core.batches import EmptyBatch
from lightning_dp.core.errors import BatchDimensionError, DPConfigurationError
from lightning_dp.core.privacy_unit import PrivacyUnit
from lightning_dp.engine import PrivateStepEngine
from lightning_dp.per_example.capture import tracing
from lightning_dp.per_example.kernels.conv_autotune import ConvAutotuner
from lightning_dp.run.callbacks import PrivacyCallback
from lightning_dp.run.checkpointing import atomic_save, is_local_path, unreadable_checkpoint
from lightning_dp.run.prepare import OnBatchNorm, prepare_module
from lightning_dp.strategies import checkpoints, loaders, privacy_unit_setup, refusals, routing
from lightning_dp.strategies.collectives import PLACEHOLDER, REAL, StepCollectives
from lightning_dp.strategies.config import PrivacyConfig
from lightning_dp.strategies.lockstep import Placeholders
from lightning_dp.strategies.norm_pass import sampler_runtime
from lightning_dp.strategies.optim import DPOptimizer


class DPStrategyBase(Strategy):
    """The DP wiring shared by :class:`DPStrategy` and the distributed ``DPDDPStrategy``."""

    trains_privately = True
    """Marks a private strategy for code that must not import this one (``prepare.trains_privately``)."""
    per_device_batch_size: bool = False
    """False: the DataLoader's batch_size is the expected *logical* batch over all devices, so q and
    ε do not depend on the device count. True: Lightning's per-device meaning (logical = × world size)."""
    world_size: int
    global_rank: int
    collectives: StepCollectives | None = None
    """What user code's collectives do in the private step (distributed strategies, from set-up; None: one
    process, where they are Lightning's)."""
    placeholders: Placeholders | None = None
    """The placeholder passes that give every rank as many ``training_step`` calls (distributed strategies)."""

    def _init_dp(self, config: PrivacyConfig) -> None:
        """Build the engine from the validated config (called by each concrete ``__init__``)."""
        self.config = config
        self.engine: PrivateStepEngine = config.build_engine()
        self.max_physical_batch_size = config.max_physical_batch_size
        checks = config.checks
        self.chunking = routing.Chunking(config.max_physical_batch_size, checks.isolate_examples)
        """How a sampled batch goes through training_step: whole, in chunks of whole units, or one unit
        (one example without units) per chunk with isolate_examples."""
        self.checks = RunChecks.build(
            checks.sensitivity,
            checks.overhead,
            config.seed,
            checks.isolate_examples,
            tuple(checks.public_buffers),
            unit="user" if config.user_level else "example",
        )
        self.on_batchnorm: OnBatchNorm = config.on_batchnorm
        self.setup_notes: list[str] = []
        self.clipping_paths = ""
        self.conv_tuner: ConvAutotuner | None = None
        """The capture's convolution methods (set at fit start, kept for the report after teardown)."""
        self._resumed = False
        self._train_loader_pass: object = refusals.NO_PASS
        self._realised_sizes: loaders.RealisedSizes | None = None
        self._batch_infos = loaders.BatchInfos()
        """Each train batch's side-channel info (units, DPIS's snapshot), taken off it as the loader yields
        it, so Lightning's batch hooks get the user's batch; ``training_step`` takes them in order."""
        self.step_counts = checkpoints.StepCounts()
        self._bound_data: loaders.BoundData | None = None
        self._bounded = privacy_unit_setup.BoundedData()
        self.privacy_unit: PrivacyUnit | None = None
        """What this run's ε covers (example or user, and how many), once the train loader is bound."""

    # -- conveniences for users and callbacks ---------------------------------------------------------
    @property
    def ledger(self) -> PrivacyLedger:
        return self.engine.ledger

    @property
    def epsilon(self) -> float:
        """ε spent so far (at the configured δ)."""
        return float(self.engine.ledger.epsilon())

    @property
    def target_epsilon(self) -> float | None:
        return self.engine.target_epsilon

    @property
    def delta(self) -> float:
        return self.engine.delta

    def planned_steps(self, trainer: Trainer, num_batches: int) -> int:
        """Optimizer steps the Trainer will run, from max_epochs, max_steps and limit_train_batches."""
        return loaders.planned_steps(trainer, num_batches)

    # -- 1. set-up ---------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            refusals.refuse_unsafe_trainer(trainer, self.precision_plugin)
            self._train_loader_pass = refusals.NO_PASS
            self.step_counts.start_fit(self.engine, trainer)
            assert self.lightning_module is not None
            self.step_counts.model_history = checkpoints.model_history(self.engine, self.lightning_module)
            self.setup_notes = prepare_module(self.lightning_module, self.on_batchnorm)
            for note in self.setup_notes:
                rank_zero_info(f"lightning-dp: {note}")
            self.engine.attach(self.lightning_module)
            self.checks.setup(self.lightning_module, self.precision_plugin.convert_input)
            self._describe_clipping_paths()
            refusals.warn_at_fit_start(trainer, self.engine)
            _ensure_privacy_callback(trainer)
        super().setup(trainer)

    def _describe_clipping_paths(self) -> None:
        """One line at fit start: which per-example path each layer takes."""
        grads = self.engine.grads
        assert grads is not None
        paths: dict[str, list[str]] = {}
        for name, module in grads.layers:
            paths.setdefault(grads.path_of(module), []).append(f"{name or '<root>'}:{type(module).__name__}")
        described = "; ".join(f"{path} {', '.join(names)}" for path, names in sorted(paths.items()))
        self.clipping_paths = f"per-example clipping ({grads.mode} mode): {described}"
        rank_zero_info(f"lightning-dp: {self.clipping_paths}")
        # each convolution's methods, chosen on its first batch by the cost model: one line per shape
        self.conv_tuner = grads.conv_tuner
        self.conv_tuner.announce = _announce  # a module function: the engine holding it still pickles

    # -- 2. optimizers --------------------------------------------------------------------------------------
    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            refusals.refuse_uncovered_parameters(self.optimizers, self.engine)
            self.optimizers = [
                DPOptimizer(o, self.engine, after_closure=self.checks.after_closure) for o in self.optimizers
            ]

    # -- 3. checkpoints --------------------------------------------------------------------------------------
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        restoring = self.step_counts.window.restoring(super().load_checkpoint)
        if restoring is not None:  # written while a resume restores: the checkpoint it restores
            checkpoint = restoring
        else:
            checkpoint[checkpoints.CHECKPOINT_KEY] = checkpoints.gather_dp_state(
                self.engine, self.world_size, self.step_counts
            )
        plain_file = type(self.checkpoint_io) is TorchCheckpointIO and storage_options is None
        if not (plain_file and is_local_path(filepath)):
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        elif self.is_global_zero:  # temp file + fsync + rename: a crash never leaves half a checkpoint
            atomic_save(checkpoint, filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        self.step_counts.window.begin(checkpoint_path, weights_only, fitting=self._fitting())
        try:
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        except Exception as err:
            problem = unreadable_checkpoint(checkpoint_path) if is_local_path(checkpoint_path) else None
            if problem is None:
                raise
            raise DPConfigurationError(problem) from err
        if self._fitting():
            checkpoints.restore_dp_state(
                self.engine, checkpoint, checkpoint_path, self.world_size, self.global_rank, self.step_counts
            )
            self._resumed = True
        return checkpoint

    # -- 4. data ---------------------------------------------------------------------------------------------------
    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self._trainer()
        if trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        self._train_loader_pass = refusals.refuse_several_train_loaders(trainer, self._train_loader_pass)
        loader = refusals.refuse_unsupported_loader(dataloader)
        num_batches = self._bind_sampler(loader)
        self.step_counts.window.end()  # the resume is complete (Lightning has restored its loops before this)
        self._plan_noise(trainer, loader, num_batches)
        sampler = self.engine.sampler
        views = self.config.augmentation_multiplicity
        self._realised_sizes = loaders.RealisedSizes(sampler.batch_sampler(num_batches), views)
        return loaders.private_loader(
            loader, self._realised_sizes, sampler.carries_batch_info, self.checks.integrity, views,
            dataset=self._bounded.dataset, infos=self._batch_infos,
        )  # fmt: skip

    def _bind_sampler(self, loader: DataLoader) -> int:
        """Fix N and the logical batch in the sampler slot (q = batch / N); the batches of an epoch."""
        assert loader.batch_size is not None
        num_samples = len(loader.dataset)  # type: ignore[arg-type]
        logical_batch = loader.batch_size * (self.world_size if self.per_device_batch_size else 1)
        public = self.config.checks.data_changes == "public"
        bound = loaders.BoundData(loader.dataset, num_samples, logical_batch)
        self._bound_data = loaders.check_reloaded_data(self._bound_data, bound, public)
        sampler = self.engine.sampler
        dataset = self._bounded.of(self.config, loader.dataset, sampler.unit == "user")
        num_samples = len(dataset)  # an example-level run with max_examples_per_user: the bounded set
        self.engine.use_train_data(dataset, loaders.CollateWithEmpty(loader.collate_fn))
        self._check_ranks_agree({"N (training examples)": num_samples, "logical batch": logical_batch})
        try:
            sampler.bind_dataset(dataset)
            sampler.bind(num_samples, logical_batch, rank=self.global_rank, world_size=self.world_size)
        except ValueError as err:
            raise DPConfigurationError(str(err)) from err
        self.privacy_unit = privacy_unit_setup.privacy_unit_of(self.config, self.engine)
        self._check_ranks_agree({"privacy units": self.privacy_unit.num_units})
        checkpoints.check_resumed_data(self.engine, self.step_counts, public)
        refusals.warn_on_large_delta(self.engine.delta, self.privacy_unit.num_units, self.privacy_unit.kind)
        return sampler.batches_per_epoch(num_samples, logical_batch)

    def _plan_noise(self, trainer: Trainer, loader: DataLoader, num_batches: int) -> None:
        """σ for the planned steps (or the sampler's own schedule); refuse a budget short of one step."""
        engine, sampler = self.engine, self.engine.sampler
        if sampler.carries_batch_info or sampler.schedules_noise:
            sampler.attach_runtime(self._sampler_runtime(trainer, loader, num_batches))
        if not engine.noise.is_set and not sampler.schedules_noise:
            loaders.calibrate(engine, loaders.planned_steps(trainer, num_batches))
        if not self._resumed:
            refusals.refuse_unaffordable_first_step(engine)
        refusals.refuse_unsplit_joint_release(engine)
        self._check_ranks_agree(
            {"q (sample rate)": sampler.sample_rate, "noise multiplier": loaders.first_sigma(engine)}
        )
        assert self.privacy_unit is not None
        rank_zero_info(privacy_unit_setup.fit_start_line(self.privacy_unit, engine))  # what the ε covers

    def _sampler_runtime(self, trainer: Trainer, loader: DataLoader, num_batches: int) -> Any:
        assert self.lightning_module is not None
        return sampler_runtime(
            self.engine, self.lightning_module, loader, self.root_device,
            lambda batch: self.batch_to_device(batch, self.root_device),
            planned_steps=loaders.planned_steps(trainer, num_batches),
            steps_per_epoch=loaders.steps_per_epoch(trainer, num_batches),
            chunk=1 if self.chunking.isolate else self.max_physical_batch_size or loader.batch_size or 256,
        )  # fmt: skip

    def _check_ranks_agree(self, fields: dict[str, Any]) -> None:
        """Distributed strategies refuse a run whose ranks disagree on ``fields`` (one process: nothing)."""
        del fields

    # -- 5. training step --------------------------------------------------------------------------------------------------
    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        if isinstance(batch, EmptyBatch):
            return batch
        moved = super().batch_to_device(batch, device, dataloader_idx)
        trainer = self._trainer()
        if trainer is not None and trainer.state.stage == RunningStage.TRAINING:
            self.checks.integrity.after_transfer(moved)
        return moved

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch, module, info = routing.batch_of(args, kwargs), self._module(), self._batch_infos.next_info()
        if not routing.begin_sampled_batch(self.engine, self._realised_sizes, batch, info, self._trainer()):
            self.step_counts.released_nothing(module)
            return None  # the budget cannot pay for this batch: nothing is released, training stops
        own = self._own_calls(batch)
        self._before_user_code(batch, args, kwargs)
        if self._stand_in(own, args, kwargs):
            return None  # a placeholder call made this empty batch's whole step (manual optimization)
        if isinstance(batch, EmptyBatch):
            return self._noise_only_step(module)
        # tracing: parameter uses outside the layers, rows taken from the batch (per_example.uses)
        with tracing(module), self._calls(REAL):
            return self._user_step(module, batch, args, kwargs)

    def _own_calls(self, batch: Any) -> int | None:
        """Distributed: how many training_step calls this rank's share of the batch takes (an empty one:
        none), counted on every rank before any call (a unit too large for one chunk is refused on all)."""
        if self.placeholders is None:
            return None
        module, chunking, units = self._module(), self.chunking, self.engine.sampled_batch.units
        if chunking.whole:  # one call, or none: nothing to refuse
            return routing.calls_of(batch, chunking, units, module)
        counted: list[int] = []
        self._refuse_together(
            lambda: counted.append(routing.calls_of(batch, chunking, units, module)), passes=False
        )
        return counted[0]

    def _stand_in(self, own: int | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """As many training_step calls on every rank: a rank with fewer than the most (``own``) first makes
        placeholder passes that stand in for the calls it lacks; their chunks add zero sums. True: they made
        an empty batch's whole step (manual optimization: the user's step released noise and stepped)."""
        placeholders = self.placeholders
        if placeholders is None or own is None:
            return False
        missing = placeholders.agree_max(own) - own
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        for i in range(missing):
            placeholders.placeholder_pass(batch_idx=batch_idx, stand_in=True)
            if own or i < missing - 1:  # an empty batch's last pass is released by its noise-only step
                self.engine.accumulate_chunk()
        return missing > 0 and not own and not self._module().automatic_optimization

    def _calls(self, role: str) -> contextlib.AbstractContextManager[None]:
        """The block is one training_step call of ``role`` (collectives); nothing on one process."""
        return contextlib.nullcontext() if self.collectives is None else self.collectives.call(role)

    def _user_step(self, module: Any, batch: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The user's ``training_step`` on the whole batch, or physical chunk by chunk (virtual batching)."""
        if self.chunking.whole:
            return super().training_step(*args, **kwargs)
        user_step, chunking = super().training_step, self.chunking
        return routing.virtual_batch_step(
            user_step, self.engine, module, batch, chunking, *args[1:], **kwargs
        )

    def _noise_only_step(self, module: Any) -> Any:
        """An empty batch's noise-only step, counted once released (a checkpoint between counts it once)."""
        output = routing.noise_only_step(self.engine, module, self.optimizers, self.root_device)
        self.step_counts.noise_only(module)
        if not module.automatic_optimization:  # the optimizers stepped here, not through optimizer_step
            self.checks.after_step()  # later writes to the model are measured from here
        return output

    def _module(self) -> Any:
        module = self.lightning_module
        assert module is not None
        return module

    def _before_user_code(self, batch: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The checks of a sampled batch (lightning_dp/checks): the batch as sampled, no state written
        between steps, and on checked steps the mixing check on what one forward will see."""
        module = self.lightning_module
        assert module is not None
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        chunks = routing.physical_chunks(batch, self.chunking, self.engine.sampled_batch.units)
        self._refuse_together(
            lambda: self.checks.before_user_code(
                self.engine, module, self._trainer(), batch, batch_idx, chunks,
                self.precision_plugin, self.root_device,
            )
        )  # fmt: skip

    def _refuse_together(self, check: Callable[[], None], passes: bool = True) -> None:
        """Run a check that may refuse the step (distributed strategies: every rank refuses together);
        ``passes``: it may run dry passes of training_step (``dp_fsdp`` answers them on the other ranks)."""
        del passes
        check()

    # -- 6. the private step ----------------------------------------------------------------------------------------------------
    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        super().post_backward(closure_loss)
        if self.engine.grads is None:
            return
        self._refuse_together(self._before_release)
        try:
            self._release()
        except BudgetExceededError as err:
            raise DPConfigurationError(refusals.budget_message(self.engine, self._trainer())) from err
        except BatchDimensionError as err:
            raise refusals.explain_batch_dimension(err, self._module(), self.engine) from err

    def _release(self) -> None:
        """The step's release: of the clipped sums, or, from a placeholder call (manual optimization), of
        noise alone (the placeholder's gradients are dropped)."""
        if self.collectives is not None and self.collectives.role == PLACEHOLDER:
            self.engine.noise_only_step()
        else:
            self.engine.privatize()

    def _before_release(self) -> None:
        """The release checks (lightning_dp/checks), and every trainable parameter an optimizer holds is in
        the private gradient (a parameter group added since set-up may hold one that is not)."""
        self.checks.before_release()
        refusals.refuse_uncovered_parameters(self.optimizers, self.engine)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.checks.after_step()  # later writes to the model are measured from here
        return output

    @override
    def on_train_end(self) -> None:
        """Steps that train on a look-ahead point (Nesterov) write their final iterate into the weights."""
        super().on_train_end()
        for optimizer in self.optimizers:
            original = optimizer.original_optimizer if isinstance(optimizer, DPOptimizer) else optimizer
            self.engine.step_slot.finalize(original)

    # -- user code's collectives (distributed strategies) ----------------------------------------------------------
    def _install_placeholders(self, placeholders: Placeholders | None = None) -> None:
        """Every rank makes as many training_step calls (``placeholders``, by default plain placeholder passes),
        and user code's collectives in them meet, over the ranks whose call has data (collectives)."""
        self.placeholders = placeholders or Placeholders(
            self._module(), lambda: self.engine.grads, self._placeholder, self.precision_plugin,
            self.root_device, self._step_collectives(),
        )  # fmt: skip
        self.placeholders.install()

    def _step_collectives(self) -> StepCollectives:
        """This strategy's :class:`StepCollectives` (made at the first distributed set-up)."""
        if self.collectives is None:
            self.collectives = StepCollectives(self.root_device)
        return self.collectives

    def _placeholder(self) -> Any:
        """One training example, collated: what a placeholder pass runs on."""
        assert self.engine.train_data is not None
        dataset, collate = self.engine.train_data
        return collate([dataset[0]])

    # Lightning's own reduce, all_gather, broadcast and barrier come later in the MRO (DDPStrategy's,
    # ModelParallelStrategy's, SingleDeviceStrategy's), not from the abstract Strategy: hence the ignores.
    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """``self.log(..., sync_dist=True)``'s reduction: in the private step's training_step calls, over
        the ranks whose call has data; a placeholder call's sends nothing (collectives)."""
        plain = super().reduce  # type: ignore[safe-super]
        if self.collectives is None:
            return plain(tensor, group=group, reduce_op=reduce_op)
        return self.collectives.reduce(tensor, group, reduce_op, plain)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Refused in the private step's calls and the checks' dry passes (collectives)."""
        if self.collectives is not None:
            self.collectives.refuse_gather("self.all_gather")
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)  # type: ignore[safe-super]

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Refused in the private step's calls and the checks' dry passes (collectives)."""
        if self.collectives is not None:
            self.collectives.refuse_gather("strategy.broadcast")
        return super().broadcast(obj, src)  # type: ignore[safe-super]

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        """Waits for nobody in a check's dry pass (every rank makes its own dry passes)."""
        if self.collectives is None or self.collectives.waits():
            super().barrier(*args, **kwargs)  # type: ignore[safe-super]

    # -- teardown --------------------------------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        if self.placeholders is not None:
            self.placeholders.remove()
        checkpoints.record_model_history(self.engine, self.lightning_module)
        self.engine.detach()
        self.optimizers = [o.original_optimizer if isinstance(o, DPOptimizer) else o for o in self.optimizers]
        super().teardown()

    def _trainer(self) -> Trainer | None:
        return self.lightning_module.trainer if self.lightning_module is not None else None

    def _fitting(self) -> bool:
        trainer = self._trainer()
        return trainer is not None and trainer.state.fn == TrainerFn.FITTING


def _announce(line: str) -> None:
    """One line of what the run chose, logged on rank 0."""
    rank_zero_info(f"lightning-dp: {line}")


def _ensure_privacy_callback(trainer: Trainer) -> None:
    """A private fit always has a PrivacyCallback: the budget stop and the report depend on it."""
    if not any(isinstance(c, PrivacyCallback) for c in trainer.callbacks):  # type: ignore[attr-defined]
        trainer.callbacks.append(PrivacyCallback())  # type: ignore[attr-defined]
