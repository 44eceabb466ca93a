"""The Trainer, loader and optimizer settings a private run refuses, each message naming the fix.

Every check runs before the first noisy release; a refusal raises ``DPConfigurationError``, a setting that
is allowed but not covered by the guarantee (a hook that sees the non-private gradient) warns.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch.optim import Optimizer
from torch.utils.data import DataLoader, IterableDataset

from lightning_dp.core.errors import BatchDimensionError, DPConfigurationError
from lightning_dp.core.rng import SEEDED_RUN_WARNING
from lightning_dp.engine import PrivateStepEngine
from lightning_dp.run.prepare import check_train_sampler
from lightning_dp.slots import Slot

NO_PASS = object()
"""``refuse_several_train_loaders``'s marker before the first train loader of a fit."""


def refuse_unsafe_trainer(trainer: Trainer, precision_plugin: Precision) -> None:
    """Gradient accumulation, gradient clipping and a GradScaler each break per-example clipping; Lightning's
    tuners train on the private data and then roll the run back."""
    refuse_tuners(trainer)
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
    if isinstance(precision_plugin, MixedPrecision) and precision_plugin.scaler is not None:
        raise DPConfigurationError(
            "precision='16-mixed' uses a GradScaler, which scales per-example gradients before clipping "
            "and skips steps based on the non-private gradient. Use precision='bf16-mixed' or '32-true'."
        )
    if "true" in str(trainer.precision) and "32" not in str(trainer.precision):
        warnings.warn(
            f"precision={trainer.precision!r} keeps no fp32 master weights; clipping norms and noise are "
            "still computed in fp32, but the update itself is rounded to low precision.",
            stacklevel=3,
        )


def refuse_tuners(trainer: Trainer) -> None:
    """``LearningRateFinder``/``BatchSizeFinder`` (also as ``Tuner(trainer).lr_find``/``scale_batch_size``) run
    trial steps on the private data, pick a setting from their noise-free losses or memory, then restore the
    initial checkpoint, which would erase those releases from the ledger: refused before their first step."""
    from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder

    tuners = {
        LearningRateFinder: "Tuner(trainer).lr_find / LearningRateFinder trains on the private data at growing "
        "learning rates and picks one from the noise-free training losses",
        BatchSizeFinder: "Tuner(trainer).scale_batch_size / BatchSizeFinder trains on the private data at "
        "growing batch sizes (each changes q) and picks one from how they ran",
    }
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        for kind, what in tuners.items():
            if isinstance(callback, kind):
                raise DPConfigurationError(
                    f"{what}, then restores the initial weights: its trial steps are releases the ledger would "
                    "have to keep, and the choice it makes is not private. Tune privately instead: "
                    "`lightning-dp tune` (docs/tuning.md) prices the whole search; or fix the setting without "
                    "the private data (for the batch size's memory, DPStrategy(max_physical_batch_size=...))."
                )


def warn_on_non_private_gradient_hooks(trainer: Trainer, engine: PrivateStepEngine) -> None:
    """``on_after_backward`` runs before the private step: whatever it logs about gradients leaks.

    It sees the non-private gradient as Lightning documents it: the fast path's weight-gradient skipping
    is turned off for such runs (the cost is paid only when a module or callback overrides the hook).
    """
    users = []
    module = trainer.lightning_module
    if type(module).on_after_backward is not LightningModule.on_after_backward:
        users.append(type(module).__name__)
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if type(callback).on_after_backward is not Callback.on_after_backward:
            users.append(type(callback).__name__)
    if engine.attached:
        engine.keep_param_grads(bool(users))
    if users:
        warnings.warn(
            f"on_after_backward in {users} sees the NON-private gradient (it runs before clipping and noise): "
            "logging or acting on it is not covered by the privacy guarantee. Use on_before_optimizer_step, "
            "which sees the private gradient. Autograd's weight gradients are computed every step for this "
            "hook (the fast path otherwise skips them).",
            stacklevel=3,
        )


def warn_at_fit_start(trainer: Trainer, engine: PrivateStepEngine) -> None:
    """The fit-start warnings: gradient hooks that see non-private gradients, and a seeded run's streams."""
    warn_on_non_private_gradient_hooks(trainer, engine)
    warn_if_seeded(engine)


def warn_if_seeded(engine: PrivateStepEngine) -> None:
    """Once per fit: a seeded run's checkpoints (and its seed) let their holder regenerate its noise."""
    owners = engine.seeded()
    if owners:
        warnings.warn(SEEDED_RUN_WARNING.format(owners=", ".join(owners)), stacklevel=3)


def refuse_laplace_shares(accountant: str, world_size: int) -> None:
    """Several processes add one noise share each; only Gaussian shares sum to the noise the ledger prices."""
    if accountant == "pure" and world_size > 1:
        raise DPConfigurationError(
            f"accountant='pure' (Laplace noise) on {world_size} processes: each rank adds its own share of the "
            "noise, and a sum of Laplace shares is not Laplace noise, so the pure ε the ledger records would "
            f"not hold (the worst case grows to about √{world_size}·ε). Train pure-ε mechanisms on one "
            "process (strategy='dp'), or use Gaussian noise with accountant='rdp'."
        )


def refuse_uncovered_parameters(optimizers: Sequence[Optimizer], engine: PrivateStepEngine) -> None:
    """Every trainable parameter an optimizer holds must get per-example gradients from a hooked layer."""
    hooked = {id(p) for p in engine.stepped_params}
    for optimizer in optimizers:
        missing = [
            p for g in optimizer.param_groups for p in g["params"] if id(p) not in hooked and p.requires_grad
        ]
        if missing:
            raise DPConfigurationError(
                f"The optimizer holds {len(missing)} trainable parameters that are not part of the "
                "LightningModule's layers, so they would get no per-example gradients (and would be stepped "
                "with their raw gradient). Optimise the module's own parameters only."
            )


def refuse_several_train_loaders(trainer: Trainer, previous: object) -> object:
    """Lightning hands the strategy each train loader of a CombinedLoader in turn, before it stores the
    combination: a second loader in the same pass (same stored combination) is refused."""
    # A Lightning without this attribute gets a fresh marker per loader: the check is then off (a test pins it).
    current = getattr(trainer.fit_loop, "_combined_loader", object())
    if previous is not NO_PASS and previous is current:
        raise DPConfigurationError(
            "train_dataloader returned several loaders (a dict or list, combined by Lightning's CombinedLoader). "
            "The ledger prices one sample rate q, but each loader's examples would be drawn at their own "
            "q = batch_size / len(dataset), so ε would be wrong for all but one of them. Return one DataLoader "
            "over one dataset (torch.utils.data.ConcatDataset joins several)."
        )
    return current


def refuse_unsupported_loader(loader: object) -> DataLoader:
    """The train loader must be a DataLoader over a map-style dataset, with a ``batch_size`` and no
    sampler of the user's that the privacy analysis would not cover."""
    if not isinstance(loader, DataLoader):
        raise DPConfigurationError(
            f"The train dataloader must be a torch DataLoader over a map-style Dataset, got {type(loader).__name__}."
        )
    if isinstance(loader.dataset, IterableDataset):
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
    return loader


def warn_on_large_delta(delta: float, num_samples: int, unit: str = "example") -> None:
    """δ ≥ 1/N (1/U for users) allows publishing one random unit outright."""
    if delta < 1.0 / num_samples:
        return
    if unit == "user":
        warnings.warn(
            f"delta={delta:g} is not below 1/U = {1.0 / num_samples:.3g} (U users): a mechanism that publishes "
            "all the data of one random user outright would meet this δ. Use delta well below 1/U.",
            stacklevel=4,
        )
    else:
        warnings.warn(
            f"delta={delta:g} is not below 1/N = {1.0 / num_samples:.3g}: a mechanism that "
            "publishes one random example outright would meet this δ. Use delta well below 1/N.",
            stacklevel=4,
        )


def refuse_unaffordable_first_step(engine: PrivateStepEngine) -> None:
    """A fresh run whose budget cannot pay for one step is refused before any data is touched (a loader set
    up again later in the run, once the budget is spent, stops cleanly at its first batch instead)."""
    if engine.ledger.steps > engine.prior_events:
        return
    affordable = engine.affordable_steps()
    if affordable is not None and affordable < 1:
        sampler = engine.sampler
        earlier = (
            f" The model's earlier private training already spent ε={engine.ledger.epsilon():.4g} of this budget:"
            " target_epsilon counts every release the model has had."
            if engine.prior_events
            else ""
        )
        raise DPConfigurationError(
            f"Not even one step fits in target_epsilon={engine.target_epsilon} at noise multiplier "
            f"{engine.noise_multiplier():.4g} and sample rate q={sampler.sample_rate:.6g} (expected "
            f"batch {sampler.expected_batch_size:g} of N={sampler.size_for_releases} examples). Raise the noise "
            "multiplier or the budget, or lower q (a smaller batch_size; q grows when the data set shrinks)."
            + earlier
        )


def refuse_unsplit_joint_release(engine: PrivateStepEngine) -> None:
    """Once σ is known, before any data is touched: a clipping that shares the step's σ with a statistic
    (quantile clipping's count) must be able to split it (its ``gradient_noise_multiplier`` refuses)."""
    sampler = engine.sampler
    if not engine.clipping.joint_statistic or sampler.schedules_noise or not engine.noise.is_set:
        return
    sigma = engine.noise_multiplier()
    if sigma is not None:
        engine.clipping.gradient_noise_multiplier(float(sigma), sampler.expected_batch_size)


def budget_message(engine: PrivateStepEngine, trainer: Trainer | None) -> str:
    """Why a step the Trainer asks for releases nothing: the budget is spent, and what forced the step."""
    forced = ""
    if trainer is not None:
        forced = f" (min_steps={trainer.fit_loop.min_steps}, min_epochs={trainer.fit_loop.min_epochs})"
    return (
        f"Privacy budget exhausted: ε={engine.ledger.epsilon():.4g} spent of target_epsilon="
        f"{engine.target_epsilon:g}, and the Trainer asks for another private step. PrivacyCallback "
        f"stops training before such a step unless min_steps or min_epochs force more{forced}: lower them, "
        "or raise target_epsilon (or the noise multiplier) so the planned steps fit."
    )


def explain_batch_dimension(
    error: BatchDimensionError, module: LightningModule, engine: PrivateStepEngine
) -> DPConfigurationError:
    """Under manual optimization, fewer rows than the sampler drew is a backward over part of the batch
    (manual gradient accumulation): say so, rather than blame the tensors' layout."""
    realised = engine.realised_batch
    calls = engine.grads.calls if engine.grads is not None else []
    if module.automatic_optimization or realised is None or not any(size < realised for _, size in calls):
        return error
    return DPConfigurationError(
        f"manual_backward ran on part of the sampled batch ({realised} examples), and the private step is "
        "released at the first backward: manual gradient accumulation (one backward per part of a batch, "
        "then one optimizer step) would clip and noise each part as a batch of its own, and the ledger "
        "prices one release per sampled batch. Call manual_backward once on the whole batch's loss; if the "
        "batch does not fit in memory, use DPStrategy(max_physical_batch_size=...) with automatic "
        "optimization, which splits it and adds the noise once."
    )


def refuse_with_users(config: Any, owner: str) -> None:
    """What a user-level run (``privacy_unit="user"`` or ``UserPoisson``) does not price in this version,
    each refused with the fix (``docs/user-level.md``; spec §6). A slot says why it cannot run over users in
    its ``refuses_user_level``."""
    slots: list[Slot] = [
        s for s in (config.sampler, config.clipping, config.noise, config.step) if s is not None
    ]
    laplace = [s.name for s in slots if s.mechanism == "laplace"]
    if config.accountant == "pure" or laplace:
        what = f"{', '.join(laplace)} (Laplace noise)" if laplace else "accountant='pure'"
        raise DPConfigurationError(
            f"{owner}: user-level DP with {what} is not priced in this version: pure ε-DP over users needs an L1 "
            "bound per user that user-level clipping does not give. Use Gaussian noise with accountant='rdp', "
            "'prv' or 'pld'."
        )
    for slot in slots:
        if slot.refuses_user_level is not None:
            raise DPConfigurationError(
                f"{owner}: {slot.name} cannot be used with user-level DP in this version: {slot.refuses_user_level}. "
                "Use the default slot (FlatClipping, ConstantNoise, the optimizer, or HeavyBall/Nesterov steps), "
                "or train at the example level."
            )
    if config.checks.data_changes == "public":
        raise DPConfigurationError(
            f"{owner}: data_changes='public' cannot be used with user-level DP in this version: the number of users "
            "U, and so q = users_per_step / U, would change between epochs. Keep the training set fixed "
            "(data_changes='refuse')."
        )
    sampler = config.sampler
    per_unit = sampler.examples_per_user if sampler is not None else config.examples_per_user
    views = int(getattr(config, "augmentation_multiplicity", 1) or 1)
    chunk = config.max_physical_batch_size
    if chunk is not None and per_unit is not None and per_unit * views > chunk:
        rows = f"examples_per_user={per_unit}" + (
            f" × augmentation_multiplicity={views} = {per_unit * views}" if views > 1 else ""
        )
        raise DPConfigurationError(
            f"{owner}: a user contributes up to {rows} rows, more than one physical chunk "
            f"of {chunk} rows: a user split across chunks would be clipped once per part, which doubles the "
            f"sensitivity. Set max_physical_batch_size ≥ {per_unit * views} (or unset it), or lower examples_per_user."
        )
