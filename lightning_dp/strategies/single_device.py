"""DPStrategy: trains any LightningModule with differential privacy on one device."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from typing_extensions import override

from lightning_dp.errors import DPConfigurationError
from lightning_dp.per_example import GradMode
from lightning_dp.prepare import OnBatchNorm
from lightning_dp.sampling.user_ids import UserKey
from lightning_dp.slots import Clipping, Noise, Sampler, Step
from lightning_dp.strategies.base import DPStrategyBase
from lightning_dp.strategies.config import DataChanges, PrivacyConfig, PrivacyUnitKind


class DPStrategy(DPStrategyBase, SingleDeviceStrategy):
    """Differentially private training (DP-SGD by default) for an unmodified LightningModule.

    Args:
        target_epsilon: privacy budget ε. σ is calibrated so the planned steps spend at most this, and
            training stops before a step that would exceed it. Defaults to 3 when neither it nor
            ``noise_multiplier`` is given.
        delta: δ of the (ε, δ) guarantee; keep it well below 1/N.
        max_grad_norm: per-example clipping bound C, an L2 norm over all trainable parameters, in the
            gradient's own units.
        noise_multiplier: σ given directly (then ``target_epsilon``, if also given, is only a budget stop).
        accountant: ``"rdp"``, ``"prv"`` or ``"pld"`` (needs ``pip install dp-accounting``); ``"pure"`` sums
            pure ε (basic composition) for Laplace steps.
        sampler: which examples form each batch (default :class:`~lightning_dp.Poisson`: each example
            joins with probability q = batch_size / N).
        clipping: how each per-example gradient is bounded (default :class:`~lightning_dp.FlatClipping`:
            L2 norm ≤ C).
        noise: σ of each step (default :class:`~lightning_dp.ConstantNoise`: one σ, given or calibrated).
        step: how the private gradient moves the weights (default: the user's own optimizer).
        on_batchnorm: ``"raise"`` or ``"replace"`` (BatchNorm → GroupNorm in place).
        loss_reduction: whether ``training_step`` returns the batch ``"mean"`` (default) or ``"sum"``.
        seed: makes sampling and noise reproducible; by default both are seeded from ``os.urandom``.
        max_physical_batch_size: split each logical batch into chunks of at most this many examples
            (virtual batching): memory no longer limits the logical batch, q or ε. Noise is added once.
        grad_sample_mode: ``"auto"`` (fast clipping without per-example gradients when every layer
            supports it), ``"fast"`` (fast where supported, materialised elsewhere) or ``"materialize"``.
        check_sensitivity: refuse a loss, forward or hook that mixes examples, before the release it would
            break: the user's step is run again on the real batch with one example removed or replaced, on
            the first batch and on random later ones within ``check_overhead`` of the training time;
            ``"every_step"`` checks every batch (audits). Turn off only for a verified model.
        check_overhead: the time the sampled checks may add, as a share of the training time without them
            (default 0.05: a fit takes about 1.05 times as long as with the checks off; the first batch's
            check always runs, so a fit of a few steps takes longer).
        isolate_examples: run each example through ``training_step`` alone (one forward and backward per
            example), so no loss or forward can mix examples by construction; slower. With users or
            ``augmentation_multiplicity`` > 1, each unit (a user's rows, an example's views) runs alone.
        public_buffers: names (or fnmatch patterns) of buffers written between steps or in forward from the
            weights, the step count or public constants only (an EMA of the weights); others are refused.
        data_changes: ``"refuse"`` (default) refuses a train loader whose data set, N or batch size
            changes between epochs (``reload_dataloaders_every_n_epochs``, a curriculum), before the next
            release: such a change read from private data is released without noise. ``"public"``
            declares that no private data decides the change (a fixed schedule); each epoch's q is priced.
        augmentation_multiplicity: K (default 1): the train ``Dataset`` is called K times per sampled
            index (its random transforms draw K views), ``training_step`` sees the K views as consecutive
            rows, and their gradients are averaged before the clip (De et al. 2022); ε does not change.
        privacy_unit: ``"example"`` (default: add/remove one item) or ``"user"`` (add/remove one user with all
            their examples; ``docs/user-level.md``): then ``user_key``, ``examples_per_user`` (k rows per sampled
            user per step) and ``users_per_step`` (B_u, q = B_u / U) are required, all public hyperparameters.
        user_key: where each example's user id is: a column, attribute or item-key name, a sequence or tensor of
            ids aligned with the dataset's indices, or a callable index -> id.
        examples_per_user: k, the most rows (examples) one sampled user contributes to a step (required with
            ``privacy_unit="user"``; public). ε does not depend on it.
        users_per_step: B_u, the expected number of users per step (required with ``privacy_unit="user"``;
            public): q = B_u / U, and the private gradient is divided by B_u.
        unit_selection: which of a sampled user's examples form its k rows: ``"random"`` (default, a uniform
            subset each step) or ``"cycle"`` (the next k, from a random start).
        unit_reduction: ``"mean"`` (default) or ``"sum"`` of a user's row gradients before the clip to C.
        max_examples_per_user: keep at most this many examples per user (a seeded per-user choice, enforced).
            On an example-level run it gives the report a user-level ε line (group privacy over k examples).
        secure: secure noise (``docs/guarantees.md``): each clipped per-example gradient is rounded onto an
            integer grid, the sum is exact in int64, and the noise is a discrete Gaussian drawn from ``os.urandom``
            (:class:`~lightning_dp.noise.discrete_gaussian.DiscreteGaussian`), so no floating-point sample can be
            attacked. Priced with a bound valid for the discrete Gaussian; the noise is 0.1 % larger and the
            per-example gradients are materialised.
        dataset_size: N declared public (U, the number of users, with ``privacy_unit="user"``): q = batch_size / N,
            the divisor q·N and the steps per epoch come from it, so nothing released reads the real size of the
            training set; the report lists it as declared. Default: the real size, assumed public.
        device: force a device; by default it comes from the Trainer's accelerator and devices.

    The privacy arguments are those of :class:`~lightning_dp.strategies.PrivacyConfig` (validated there);
    the last four are Lightning's.
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
        check_sensitivity: bool | Literal["every_step"] = True,
        check_overhead: float = 0.05,
        isolate_examples: bool = False,
        public_buffers: Sequence[str] = (),
        data_changes: DataChanges = "refuse",
        augmentation_multiplicity: int = 1,
        privacy_unit: PrivacyUnitKind = "example",
        user_key: UserKey | None = None,
        examples_per_user: int | None = None,
        users_per_step: int | None = None,
        unit_selection: Literal["random", "cycle"] = "random",
        unit_reduction: Literal["mean", "sum"] = "mean",
        max_examples_per_user: int | None = None,
        secure: bool = False,
        dataset_size: int | None = None,
        device: str | torch.device | None = None,
        accelerator: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        config = PrivacyConfig.pick(locals(), owner=type(self).__name__)
        SingleDeviceStrategy.__init__(
            self,
            device=device if device is not None else "cpu",
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._device_given = device is not None
        self.parallel_devices: list[torch.device] | None = None  # filled in by the Trainer's connector
        self._init_dp(config)

    @property
    @override
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
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="DP-SGD on one device (lightning-dp)", override=True
        )
