"""DPStrategy: trains any LightningModule with differential privacy on one device.

The strategy only wires things together, in the order Lightning calls it:

1. ``setup``           refuse settings that break privacy; fix the module in place; attach hooks
2. ``setup_optimizers``  wrap the user's optimizer so the step slot moves the weights
3. ``load_checkpoint``   restore the ledger, the slots and the RNG streams (after set-up)
4. ``process_dataloader`` swap the train loader for the sampler slot's batches; calibrate σ
5. ``training_step``     an empty batch never reaches user code: it becomes a noise-only step
6. ``post_backward``     clip, price in the ledger, add noise: every later hook sees private grads
7. ``save_checkpoint``   store the privacy state next to the weights
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import SingleDeviceStrategy, Strategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset

from lightning_dp import validation
from lightning_dp.accounting import BudgetExceededError
from lightning_dp.batches import BatchWithInfo, EmptyBatch, InfoDataset, batch_length, split_batch
from lightning_dp.checkpointing import (
    atomic_save,
    check_privacy_state,
    check_resumed_counts,
    is_local_path,
    unreadable_checkpoint,
)
from lightning_dp.clipping import FlatClipping
from lightning_dp.engine import PrivateStepEngine
from lightning_dp.errors import DPConfigurationError
from lightning_dp.noise import ConstantNoise
from lightning_dp.optim import DPOptimizer
from lightning_dp.per_example import GradMode
from lightning_dp.prepare import OnBatchNorm, check_train_sampler, prepare_module
from lightning_dp.sampling import Poisson
from lightning_dp.sensitivity import check_sensitivity, training_step_loss
from lightning_dp.slots import Clipping, Noise, Sampler, SamplerRuntime, Step
from lightning_dp.validation import number

DEFAULT_TARGET_EPSILON = 3.0
CHECKPOINT_KEY = "lightning_dp"


class _CollateWithEmpty:
    """The user's collate function, except that an empty index list becomes an ``EmptyBatch``."""

    def __init__(self, collate_fn: Any) -> None:
        self.collate_fn = collate_fn

    def __call__(self, samples: list[Any]) -> Any:
        batch = EmptyBatch() if len(samples) == 0 else self.collate_fn(list(samples))
        info = getattr(samples, "info", None)
        return batch if info is None else BatchWithInfo(batch, info)


class _RealisedSizes(torch.utils.data.Sampler[list[int]]):
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


_NO_PASS = object()


def refuse_several_train_loaders(trainer: Trainer, previous: object) -> object:
    """Lightning hands the strategy each train loader of a CombinedLoader in turn, before it stores the
    combination: a second loader in the same pass (same stored combination) is refused."""
    # A Lightning without this attribute gets a fresh marker per loader: the check is then off (a test pins it).
    current = getattr(trainer.fit_loop, "_combined_loader", object())
    if previous is not _NO_PASS and previous is current:
        raise DPConfigurationError(
            "train_dataloader returned several loaders (a dict or list, combined by Lightning's CombinedLoader). "
            "The ledger prices one sample rate q, but each loader's examples would be drawn at their own "
            "q = batch_size / len(dataset), so ε would be wrong for all but one of them. Return one DataLoader "
            "over one dataset (torch.utils.data.ConcatDataset joins several)."
        )
    return current


class DPStrategyMixin(Strategy):
    """The DP wiring shared by :class:`DPStrategy` and the distributed ``DPDDPStrategy``."""

    engine: PrivateStepEngine
    on_batchnorm: OnBatchNorm
    per_device_batch_size: bool = False
    """False: the DataLoader's batch_size is the expected *logical* batch over all devices, so q and
    ε do not depend on the device count. True: Lightning's per-device meaning (logical = × world size)."""
    world_size: int
    global_rank: int

    def _init_dp(
        self,
        *,
        target_epsilon: float | None,
        delta: float,
        max_grad_norm: float,
        noise_multiplier: float | None,
        accountant: Literal["rdp", "prv", "pld", "pure"],
        sampler: Sampler | None,
        clipping: Clipping | None,
        noise: Noise | None,
        step: Step | None,
        on_batchnorm: OnBatchNorm,
        loss_reduction: Literal["mean", "sum"],
        seed: int | None,
        max_physical_batch_size: int | None = None,
        grad_sample_mode: GradMode = "auto",
        check_sensitivity: bool = True,
    ) -> None:
        """Validate the privacy arguments and build the engine (called by each concrete __init__)."""
        self.check_sensitivity = validation.flag(
            check_sensitivity, "check_sensitivity", owner=type(self).__name__
        )
        self._sensitivity_checked = False
        self.max_physical_batch_size = max_physical_batch_size
        _validate_privacy_arguments(
            target_epsilon, delta, max_grad_norm, noise_multiplier, accountant, loss_reduction,
            max_physical_batch_size, seed, type(self).__name__,
        )  # fmt: skip
        if noise is not None and noise_multiplier is not None:
            raise DPConfigurationError("Give either noise=... or noise_multiplier=..., not both.")
        if target_epsilon is None and noise_multiplier is None and (noise is None or not noise.is_set):
            target_epsilon = DEFAULT_TARGET_EPSILON
        if noise_multiplier == 0:
            warnings.warn("noise_multiplier=0 adds no noise: this run has no privacy (ε = ∞).", stacklevel=3)
        self.on_batchnorm: OnBatchNorm = on_batchnorm
        self.engine = PrivateStepEngine(
            sampler=sampler if sampler is not None else Poisson(seed=seed),
            clipping=clipping if clipping is not None else FlatClipping(),
            noise=noise if noise is not None else ConstantNoise(noise_multiplier),
            step=step if step is not None else Step(),
            max_grad_norm=max_grad_norm,
            delta=delta,
            target_epsilon=target_epsilon,
            accountant=accountant,
            loss_reduction=loss_reduction,
            seed=seed,
            grad_sample_mode=grad_sample_mode,
        )
        self.engine.max_physical_batch_size = max_physical_batch_size
        self.setup_notes: list[str] = []
        self._resumed = False
        self._train_loader_pass: object = _NO_PASS
        self._realised_sizes: _RealisedSizes | None = None

    # -- conveniences for users and callbacks ---------------------------------------------------------
    @property
    def ledger(self) -> Any:
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

    # -- 1. set-up ---------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self._refuse_unsafe_trainer(trainer)
            self._train_loader_pass = _NO_PASS
            module = self.lightning_module
            assert module is not None
            self.setup_notes = prepare_module(module, self.on_batchnorm)
            for note in self.setup_notes:
                rank_zero_info(f"lightning-dp: {note}")
            self.engine.attach(module)
            self._check_hooks()
            _warn_on_non_private_gradient_hooks(trainer)
            self._ensure_privacy_callback(trainer)
        super().setup(trainer)

    @staticmethod
    def _ensure_privacy_callback(trainer: Trainer) -> None:
        from lightning_dp.callbacks import PrivacyCallback

        if not any(isinstance(c, PrivacyCallback) for c in trainer.callbacks):  # type: ignore[attr-defined]
            trainer.callbacks.append(PrivacyCallback())  # type: ignore[attr-defined]

    def _refuse_unsafe_trainer(self, trainer: Trainer) -> None:
        if trainer.accumulate_grad_batches != 1:
            raise DPConfigurationError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) breaks DP-SGD: an example "
                "can land in several micro-batches and be clipped once in each, and Lightning rescales the "
                "loss before clipping. Use a larger batch_size for a larger logical batch."
            )
        if trainer.gradient_clip_val:
            raise DPConfigurationError(
                f"Trainer(gradient_clip_val={trainer.gradient_clip_val}) clips the aggregated gradient, which "
                "is not per-example clipping and gives no privacy. Remove it and set "
                "DPStrategy(max_grad_norm=...) instead."
            )
        plugin = self.precision_plugin
        if isinstance(plugin, MixedPrecision) and plugin.scaler is not None:
            raise DPConfigurationError(
                "precision='16-mixed' uses a GradScaler, which scales per-example gradients before clipping "
                "and skips steps based on the non-private gradient. Use precision='bf16-mixed' or '32-true'."
            )
        if "true" in str(trainer.precision) and "32" not in str(trainer.precision):
            warnings.warn(
                f"precision={trainer.precision!r} keeps no fp32 master weights; clipping norms and noise are "
                "still computed in fp32, but the update itself is rounded to low precision.",
                stacklevel=2,
            )

    def _check_hooks(self) -> None:
        """One line at fit start: which per-example path each layer takes."""
        grads = self.engine.grads
        assert grads is not None
        paths: dict[str, list[str]] = {}
        for name, module in grads.layers:
            paths.setdefault(grads.path_of(module), []).append(f"{name or '<root>'}:{type(module).__name__}")
        described = "; ".join(f"{path} {', '.join(names)}" for path, names in sorted(paths.items()))
        self.clipping_paths = f"per-example clipping ({grads.mode} mode): {described}"
        rank_zero_info(f"lightning-dp: {self.clipping_paths}")

    # -- 2. optimizers --------------------------------------------------------------------------------------
    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        hooked = {id(p) for p in self.engine.params}
        for optimizer in self.optimizers:
            missing = [
                p
                for g in optimizer.param_groups
                for p in g["params"]
                if id(p) not in hooked and p.requires_grad
            ]
            if missing:
                raise DPConfigurationError(
                    f"The optimizer holds {len(missing)} trainable parameters that are not part of the "
                    "LightningModule's layers, so they would get no per-example gradients."
                )
        self.optimizers = [DPOptimizer(o, self.engine) for o in self.optimizers]

    # -- 3. checkpoints --------------------------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        checkpoint[CHECKPOINT_KEY] = self._gather_dp_state()
        if (
            type(self.checkpoint_io) is TorchCheckpointIO
            and storage_options is None
            and is_local_path(filepath)
        ):
            if self.is_global_zero:  # temp file + fsync + rename: a crash never leaves half a checkpoint
                atomic_save(checkpoint, filepath)
            return
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _gather_dp_state(self) -> dict[str, Any]:
        """Rank 0's privacy state plus every rank's own (its sampling and noise streams differ)."""
        state = self.engine.state_dict()
        states: list[Any] = [state]
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            states = [None] * self.world_size
            dist.all_gather_object(states, state)
        return dict(states[0], ranks=states, world_size=self.world_size)

    def _rank_dp_state(self, state: dict[str, Any]) -> dict[str, Any]:
        saved_world = state.get("world_size", 1)
        if saved_world != self.world_size:
            raise DPConfigurationError(
                f"The checkpoint was written by {saved_world} processes, this run has {self.world_size}. Each "
                "rank's sampling and noise streams are in the checkpoint and cannot be re-split; resume with "
                f"the same number of devices × nodes ({saved_world})."
            )
        ranks = state.get("ranks")
        return ranks[self.global_rank] if ranks else state

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        try:
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        except Exception as err:
            problem = unreadable_checkpoint(checkpoint_path) if is_local_path(checkpoint_path) else None
            if problem is None:
                raise
            raise DPConfigurationError(problem) from err
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            state = checkpoint.get(CHECKPOINT_KEY)
            if state is None:
                raise DPConfigurationError(
                    f"The checkpoint {checkpoint_path} has no privacy state (ledger, sampler and noise streams), "
                    "so resuming would restart ε at zero. Resume only from checkpoints written by DPStrategy; "
                    "to start DP training from non-private weights, load them into the module and call fit "
                    "without ckpt_path."
                )
            rank_state = self._rank_dp_state(state)
            check_privacy_state(rank_state, checkpoint_path)
            try:
                self.engine.load_state_dict(rank_state)
            except ValueError as err:
                raise DPConfigurationError(str(err)) from err
            check_resumed_counts(self.engine, rank_state, checkpoint.get("global_step"), checkpoint_path)
            self._resumed = True
        return checkpoint

    # -- 4. data ---------------------------------------------------------------------------------------------------
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        self._train_loader_pass = refuse_several_train_loaders(trainer, self._train_loader_pass)
        if not isinstance(dataloader, DataLoader):
            raise DPConfigurationError(
                f"The train dataloader must be a torch DataLoader over a map-style Dataset, got {type(dataloader).__name__}."
            )
        return self._private_loader(trainer, dataloader)

    def _private_loader(self, trainer: Trainer, loader: DataLoader) -> DataLoader:
        dataset = loader.dataset
        if isinstance(dataset, IterableDataset):
            raise DPConfigurationError(
                "The train dataset is an IterableDataset: Poisson sampling needs random access to every "
                "example (len() and indexing). Use a map-style Dataset."
            )
        check_train_sampler(loader)
        if loader.batch_size is None:
            raise DPConfigurationError(
                "The train DataLoader has no batch_size (it uses a custom batch_sampler). DP training replaces "
                "the sampler and reads batch_size as the expected batch size: pass batch_size=... instead."
            )
        num_samples = len(dataset)  # type: ignore[arg-type]
        self.engine.train_data = (dataset, _CollateWithEmpty(loader.collate_fn))
        sampler = self.engine.sampler
        world = self.world_size
        logical_batch = loader.batch_size * (world if self.per_device_batch_size else 1)
        self._check_ranks_agree({"N (training examples)": num_samples, "logical batch": logical_batch})
        try:
            sampler.bind(num_samples, logical_batch, rank=self.global_rank, world_size=world)
        except ValueError as err:
            raise DPConfigurationError(str(err)) from err
        self._check_resumed_data(sampler)
        num_batches = max(1, math.ceil(num_samples / logical_batch))
        if self.engine.delta >= 1.0 / num_samples:
            warnings.warn(
                f"delta={self.engine.delta:g} is not below 1/N = {1.0 / num_samples:.3g}: a mechanism that "
                "publishes one random example outright would meet this δ. Use delta well below 1/N.",
                stacklevel=2,
            )
        if sampler.carries_batch_info or sampler.schedules_noise:
            self._attach_sampler_runtime(trainer, sampler, dataset, loader, num_batches)
        if not self.engine.noise.is_set and not sampler.schedules_noise:
            self._calibrate(trainer, num_batches)
        self._check_first_step_affordable()
        self._check_ranks_agree({"q (sample rate)": sampler.sample_rate, "noise multiplier": self._sigma()})
        self._realised_sizes = _RealisedSizes(sampler.batch_sampler(num_batches))
        return DataLoader(
            InfoDataset(dataset) if sampler.carries_batch_info else dataset,
            batch_sampler=self._realised_sizes,
            collate_fn=_CollateWithEmpty(loader.collate_fn),
            num_workers=loader.num_workers,
            pin_memory=loader.pin_memory,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context,
            persistent_workers=loader.persistent_workers,
            prefetch_factor=loader.prefetch_factor if loader.num_workers > 0 else None,
        )

    def _sigma(self) -> float | None:
        """The noise slot's σ of the first step, once set (None while a sampler schedules it)."""
        noise = self.engine.noise
        return noise.noise_multiplier(0) if noise.is_set and not self.engine.sampler.schedules_noise else None

    def _check_ranks_agree(self, fields: dict[str, Any]) -> None:
        """Distributed strategies refuse a run whose ranks disagree on ``fields`` (one process: nothing)."""
        del fields

    def _attach_sampler_runtime(
        self, trainer: Trainer, sampler: Sampler, dataset: Any, loader: DataLoader, num_batches: int
    ) -> None:
        """Lend a model-dependent sampler (DPIS) a norm pass over the data, the ledger and the plan."""
        noise = self.engine.noise
        sampler.attach_runtime(
            SamplerRuntime(
                norms=lambda indices: self._example_norms(dataset, loader, indices),
                ledger=self.engine.ledger,
                target_epsilon=self.engine.target_epsilon,
                delta=self.engine.delta,
                planned_steps=self.planned_steps(trainer, num_batches),
                steps_per_epoch=self._steps_per_epoch(trainer, num_batches),
                max_grad_norm=self.engine.max_grad_norm,
                fixed_noise_multiplier=noise.noise_multiplier(0) if noise.is_set else None,
                clipping=self.engine.clipping,
                all_reduce=self._cpu_all_reduce if self.engine.all_reduce is not None else None,
            )
        )

    def _cpu_all_reduce(self, tensors: list[Tensor]) -> list[Tensor]:
        assert self.engine.all_reduce is not None
        return [t.cpu() for t in self.engine.all_reduce([t.to(self.root_device) for t in tensors])]

    @staticmethod
    def _steps_per_epoch(trainer: Trainer, num_batches: int) -> int:
        limit = trainer.limit_train_batches
        if isinstance(limit, int):
            return max(1, min(num_batches, limit))
        return max(1, int(num_batches * float(limit))) if limit is not None else num_batches

    def _example_norms(self, dataset: Any, loader: DataLoader, indices: Tensor) -> Tensor:
        """Per-example gradient norms of ``dataset[indices]`` at the current weights (nothing released).

        The loss is the module's ``dp_per_sample_loss(batch)`` when it has one, else its
        ``training_step`` (with logging detached, so the pass leaves no trace in the metrics).
        """
        module = self.lightning_module
        assert module is not None
        chunk = self.max_physical_batch_size or loader.batch_size or 256
        per_sample = getattr(module, "dp_per_sample_loss", None)
        mean = self.engine.loss_reduction == "mean"

        def batches() -> Any:
            for start in range(0, len(indices), chunk):
                samples = [dataset[int(i)] for i in indices[start : start + chunk]]
                yield self.batch_to_device(loader.collate_fn(samples), self.root_device)

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
            return self.engine.example_norms(batches(), loss_fn)
        finally:
            module.train(was_training)

    def _check_resumed_data(self, sampler: Sampler) -> None:
        saved_n, saved_q = getattr(sampler, "restored_shape", (None, None))
        if (
            self._resumed
            and saved_n is not None
            and saved_q is not None
            and (saved_n, saved_q) != (sampler.num_samples, sampler.sample_rate)
        ):
            raise DPConfigurationError(
                f"The checkpoint was trained on N={saved_n} with sample rate {saved_q:.6g}; this run has "
                f"N={sampler.num_samples}, rate {sampler.sample_rate:.6g}. The ledger cannot continue across a "
                f"different data set or batch size: {_shape_change(saved_n, saved_q, sampler)} Resume with the "
                "same training set and batch_size, or start a new run without ckpt_path (its ε then adds to "
                "the first run's)."
            )

    def planned_steps(self, trainer: Trainer, steps_per_epoch: int) -> int:
        """Optimizer steps the Trainer will run, from max_epochs, max_steps and limit_train_batches."""
        limit = trainer.limit_train_batches
        if isinstance(limit, int):
            steps_per_epoch = min(steps_per_epoch, limit)
        elif limit is not None:
            steps_per_epoch = int(steps_per_epoch * float(limit))
        max_epochs = trainer.fit_loop.max_epochs
        max_steps = trainer.max_steps
        by_epochs = steps_per_epoch * max_epochs if max_epochs is not None and max_epochs >= 0 else None
        by_steps = max_steps if max_steps is not None and max_steps >= 0 else None
        candidates = [n for n in (by_epochs, by_steps) if n is not None]
        if not candidates:
            raise DPConfigurationError(
                "Calibrating σ from target_epsilon needs a finite training length: set max_epochs or max_steps "
                "(or give noise_multiplier directly)."
            )
        return max(1, min(candidates))

    def _calibrate(self, trainer: Trainer, steps_per_epoch: int) -> None:
        target = self.engine.target_epsilon
        assert target is not None
        steps = self.planned_steps(trainer, steps_per_epoch)
        try:
            self.engine.noise.calibrate(
                target, self.engine.delta, self.engine.sampler, steps, self.engine.accountant
            )
        except ValueError as err:
            raise DPConfigurationError(f"target_epsilon={target} cannot be met: {err}") from err
        rank_zero_info(
            f"lightning-dp: noise multiplier {self.engine.noise.noise_multiplier(0):.4f} for ε={target:g} over "
            f"{steps} steps (q={self.engine.sampler.sample_rate:.5f})"
        )

    def _check_first_step_affordable(self) -> None:
        affordable = self.engine.affordable_steps()
        if affordable is not None and affordable < 1 and not self._resumed:
            sampler = self.engine.sampler
            raise DPConfigurationError(
                f"Not even one step fits in target_epsilon={self.engine.target_epsilon} at noise multiplier "
                f"{self.engine.noise_multiplier():.4g} and sample rate q={sampler.sample_rate:.6g} (expected "
                f"batch {sampler.expected_batch_size:g} of N={sampler.num_samples} examples). Raise the noise "
                "multiplier or the budget, or lower q (a smaller batch_size; q grows when the data set shrinks)."
            )

    # -- 5. training step --------------------------------------------------------------------------------------------------
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        if isinstance(batch, BatchWithInfo):
            return BatchWithInfo(self.batch_to_device(batch.batch, device, dataloader_idx), batch.info)
        if isinstance(batch, EmptyBatch):
            return batch
        return super().batch_to_device(batch, device, dataloader_idx)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._sensitivity_checked:  # once per fit, before the first release
            self._sensitivity_checked = True
            check_sensitivity(self)
        batch = args[0] if args else kwargs.get("batch")
        if isinstance(batch, BatchWithInfo):  # the sampler's snapshot for this batch, then the user's batch
            self.engine.sampler.begin_step(batch.info)
            batch = batch.batch
            args = (batch, *args[1:]) if args else args
            if not args:
                kwargs["batch"] = batch
        self.engine.batch = batch
        if not self._begin_sampled_batch(batch):
            return None
        if isinstance(batch, EmptyBatch):
            return self._noise_only_step()
        if self.max_physical_batch_size is not None:
            return self._virtual_batch_step(batch, *args[1:], **kwargs)
        return super().training_step(*args, **kwargs)

    def _begin_sampled_batch(self, batch: Any) -> bool:
        """Before user code sees a sampled batch: it may make one release, of its realised size, and
        only if the budget pays for it. False: the budget is spent, so the step releases nothing, user
        code does not run and training stops (a step forced past the budget stop, or a resumed run)."""
        realised = self._realised_sizes.next_size() if self._realised_sizes is not None else None
        if realised is not None and (realised == 0) != isinstance(batch, EmptyBatch):
            realised = None  # not the batch the sizes were noted for (a loader Lightning did not get from us)
        self.engine.begin_batch(realised)
        affordable = self.engine.affordable_steps(drawn=True)
        if affordable is None or affordable >= 1:
            return True
        self.engine.halted = True
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and not trainer.should_stop:
            rank_zero_info(f"lightning-dp: {self._budget_message()} This step releases nothing; stopping.")
            trainer.should_stop = True
        return False

    def _budget_message(self) -> str:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        forced = ""
        if trainer is not None:
            forced = f" (min_steps={trainer.fit_loop.min_steps}, min_epochs={trainer.fit_loop.min_epochs})"
        return (
            f"Privacy budget exhausted: ε={self.engine.ledger.epsilon():.4g} spent of target_epsilon="
            f"{self.engine.target_epsilon:g}, and the Trainer asks for another private step. PrivacyCallback "
            f"stops training before such a step unless min_steps or min_epochs force more{forced}: lower them, "
            "or raise target_epsilon (or the noise multiplier) so the planned steps fit."
        )

    def _virtual_batch_step(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        """Run the user's training_step on each physical chunk; Lightning backpropagates the last one."""
        module = self.lightning_module
        assert module is not None
        assert self.max_physical_batch_size is not None
        if not module.automatic_optimization:
            raise DPConfigurationError(
                "max_physical_batch_size needs automatic optimization; with manual optimization split the "
                "batch yourself and call engine.accumulate_chunk() between backward passes."
            )
        kwargs.pop("batch", None)
        *chunks, last = split_batch(batch, self.max_physical_batch_size)
        for chunk in chunks:
            self.engine.chunk_batch = batch_length(chunk)
            output = super().training_step(chunk, *args, **kwargs)
            loss = output["loss"] if isinstance(output, Mapping) else output
            if isinstance(loss, Tensor):
                loss.backward()
            self.engine.accumulate_chunk()
        if chunks:
            self.engine.chunk_batch = batch_length(last)
        return super().training_step(last, *args, **kwargs)

    def _noise_only_step(self) -> Tensor | None:
        module = self.lightning_module
        assert module is not None
        if module.automatic_optimization:
            # A graph leaf so Lightning's backward runs and post_backward releases pure noise.
            return torch.zeros((), device=self.root_device, requires_grad=True)
        # One noise-only release for the batch; every optimizer then steps on its share of it.
        for optimizer in self.optimizers:
            optimizer.zero_grad()
        ctx = self.engine.noise_only_step()
        for optimizer in self.optimizers:
            self.engine.pending_ctx = ctx
            optimizer.step()
        return None

    # -- 6. the private step ----------------------------------------------------------------------------------------------------
    def post_backward(self, closure_loss: Tensor) -> None:
        super().post_backward(closure_loss)
        if self.engine.grads is None:
            return
        try:
            self.engine.privatize()
        except BudgetExceededError as err:
            raise DPConfigurationError(self._budget_message()) from err

    def on_train_end(self) -> None:
        """Steps that train on a look-ahead point (Nesterov) write their final iterate into the weights."""
        super().on_train_end()
        finalize = getattr(self.engine.step_slot, "finalize", None)
        if callable(finalize):
            for optimizer in self.optimizers:
                finalize(optimizer.original_optimizer if isinstance(optimizer, DPOptimizer) else optimizer)

    # -- teardown --------------------------------------------------------------------------------------------------
    def teardown(self) -> None:
        self.engine.detach()
        self.optimizers = [o.original_optimizer if isinstance(o, DPOptimizer) else o for o in self.optimizers]
        super().teardown()


class DPStrategy(DPStrategyMixin, SingleDeviceStrategy):
    """Differentially private training (DP-SGD by default) for an unmodified LightningModule.

    Args:
        target_epsilon: privacy budget ε. σ is calibrated so the planned steps spend at most this, and
            training stops before a step that would exceed it. Defaults to 3 when neither it nor
            ``noise_multiplier`` is given.
        delta: δ of the (ε, δ) guarantee; keep it well below 1/N.
        max_grad_norm: per-example clipping bound C.
        noise_multiplier: σ given directly (then ``target_epsilon``, if also given, is only a budget stop).
        accountant: ``"rdp"``, ``"prv"`` or ``"pld"`` (needs ``pip install dp-accounting``); ``"pure"`` sums
            pure ε (basic composition) for Laplace steps.
        sampler, clipping, noise, step: the four slots (defaults: Poisson, flat L2, constant σ, the
            user's optimizer).
        on_batchnorm: ``"raise"`` or ``"replace"`` (BatchNorm → GroupNorm in place).
        loss_reduction: whether ``training_step`` returns the batch ``"mean"`` (default) or ``"sum"``.
        seed: makes sampling and noise reproducible; by default both are seeded from ``os.urandom``.
        max_physical_batch_size: split each logical batch into chunks of at most this many examples
            (virtual batching): memory no longer limits the logical batch, q or ε. Noise is added once.
        grad_sample_mode: ``"auto"`` (fast clipping without per-example gradients when every layer
            supports it), ``"fast"`` (fast where supported, materialised elsewhere) or ``"materialize"``.
        check_sensitivity: at fit start, refuse a loss or forward that mixes examples (leave-one-out
            check on a few train examples; nothing is released). Turn off only for a verified model.
        device: force a device; by default it comes from the Trainer's accelerator and devices.
    """

    strategy_name = "dp"

    def __init__(
        self,
        target_epsilon: float | None = None,
        delta: float = 1e-5,
        max_grad_norm: float = 1.0,
        noise_multiplier: float | None = None,
        accountant: Literal["rdp", "prv", "pld", "pure"] = "rdp",
        sampler: Sampler | None = None,
        clipping: Clipping | None = None,
        noise: Noise | None = None,
        step: Step | None = None,
        on_batchnorm: OnBatchNorm = "raise",
        loss_reduction: Literal["mean", "sum"] = "mean",
        seed: int | None = None,
        max_physical_batch_size: int | None = None,
        grad_sample_mode: GradMode = "auto",
        check_sensitivity: bool = True,
        device: str | torch.device | None = None,
        accelerator: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        SingleDeviceStrategy.__init__(
            self,
            device=device if device is not None else "cpu",
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._device_given = device is not None
        self.parallel_devices: list[torch.device] | None = None  # filled in by the Trainer's connector
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
            check_sensitivity=check_sensitivity,
        )

    # -- device ----------------------------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        if not self._device_given and self.parallel_devices:
            if len(self.parallel_devices) > 1:
                raise DPConfigurationError(
                    f"DPStrategy trains on one device, but the Trainer asked for {len(self.parallel_devices)}. "
                    "Use devices=1, or the distributed strategy (strategy='dp_ddp')."
                )
            return self.parallel_devices[0]
        return self._root_device

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="DP-SGD on one device (lightning-dp)", override=True
        )


def _validate_privacy_arguments(
    target_epsilon: float | None,
    delta: float,
    max_grad_norm: float,
    noise_multiplier: float | None,
    accountant: str,
    loss_reduction: str,
    max_physical_batch_size: int | None = None,
    seed: int | None = None,
    owner: str = "DPStrategy",
) -> None:
    """Type and range of every numeric argument, named in the message (lightning_dp/validation.py)."""
    number(target_epsilon, "target_epsilon", owner=owner, low=0, low_open=True, optional=True)
    number(
        delta, "delta", owner=owner, low=0, high=1, low_open=True, high_open=True,
        hint=" Typical values are 1e-5 or below 1/N.",
    )  # fmt: skip
    number(
        max_grad_norm, "max_grad_norm", owner=owner, low=0, low_open=True, allow_inf=True,
        hint=" It is the clipping bound C.",
    )  # fmt: skip
    number(noise_multiplier, "noise_multiplier", owner=owner, low=0, optional=True)
    number(
        max_physical_batch_size, "max_physical_batch_size", owner=owner, low=1, integer=True, optional=True
    )
    validation.seed(seed, owner=owner)
    if math.isinf(max_grad_norm) and (
        noise_multiplier is None or noise_multiplier > 0 or target_epsilon is not None
    ):
        raise DPConfigurationError(
            f"{owner}: max_grad_norm=inf with noise: the noise's standard deviation is σ·C, so an unbounded C "
            "turns every weight into NaN and bounds no example's contribution. Give a finite clipping bound "
            "(e.g. max_grad_norm=1.0); C=inf is accepted only with noise_multiplier=0 (no privacy)."
        )
    if accountant not in ("rdp", "prv", "pld", "pure"):
        raise DPConfigurationError(f"accountant must be 'rdp', 'prv', 'pld' or 'pure', got {accountant!r}.")
    if loss_reduction not in ("mean", "sum"):
        raise DPConfigurationError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}.")


def _shape_change(saved_n: int, saved_q: float, sampler: Sampler) -> str:
    """One sentence on what changed between the checkpoint's data and this run's, and what it does to q."""
    n, q = sampler.num_samples, sampler.sample_rate
    if n == saved_n:
        return f"the data set has the same N, but batch_size changed q from {saved_q:.6g} to {q:.6g}."
    change = "shrank" if n < saved_n else "grew"
    return (
        f"the training set {change} from {saved_n} to {n} examples (by {abs(n - saved_n)}), which changed q "
        f"from {saved_q:.6g} to {q:.6g}."
    )


def _warn_on_non_private_gradient_hooks(trainer: Trainer) -> None:
    """``on_after_backward`` runs before the private step: whatever it logs about gradients leaks.

    It sees the non-private gradient as Lightning documents it: the fast path's weight-gradient skipping
    is turned off for such runs (the cost is paid only when a module or callback overrides the hook).
    """
    from lightning.pytorch import Callback, LightningModule

    users = []
    module = trainer.lightning_module
    if type(module).on_after_backward is not LightningModule.on_after_backward:
        users.append(type(module).__name__)
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if type(callback).on_after_backward is not Callback.on_after_backward:
            users.append(type(callback).__name__)
    grads = getattr(getattr(trainer.strategy, "engine", None), "grads", None)
    if grads is not None:
        grads.keep_param_grads = bool(users)
    if users:
        warnings.warn(
            f"on_after_backward in {users} sees the NON-private gradient (it runs before clipping and noise): "
            "logging or acting on it is not covered by the privacy guarantee. Use on_before_optimizer_step, "
            "which sees the private gradient. Autograd's weight gradients are computed every step for this "
            "hook (the fast path otherwise skips them).",
            stacklevel=2,
        )
