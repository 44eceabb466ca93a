"""Who ends the run: the budget or the Trainer. Steps that spend until their budget is used up (DP-AGD,
the adaptive line search) must be stopped by the budget, and say so when the Trainer cut them off."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_dp.engine import PrivateStepEngine


def trainer_limit(trainer: Any) -> str | None:
    """The Trainer setting that ended (or will end) training, as the user would write it; None if unbounded."""
    max_steps = trainer.max_steps
    max_epochs = trainer.fit_loop.max_epochs
    if max_steps is not None and 0 <= max_steps <= trainer.global_step:
        return f"max_steps={max_steps}"
    if max_epochs is not None and 0 <= max_epochs <= trainer.current_epoch:
        return f"max_epochs={max_epochs}"
    if trainer.should_stop:
        return "a callback (e.g. EarlyStopping) that set trainer.should_stop"
    return None


def warn_on_minibatch_adaptive_step(engine: PrivateStepEngine) -> None:
    """A zCDP filter has no amplification by subsampling: a minibatch costs a full batch's privacy."""
    step = engine.step_slot
    if step.charges_unsampled and engine.sampler.sample_rate < 1.0:
        warnings.warn(
            f"{step.name} charges each gradient measurement as if it read the whole data set (its zCDP "
            "privacy filter has no amplification by subsampling), so a minibatch of sample rate "
            f"q = {engine.sampler.sample_rate:.3g} costs as much per step as a full batch while measuring "
            "less. Use the full batch (the train DataLoader's batch_size = the number of examples; "
            "max_physical_batch_size splits it in memory).",
            stacklevel=2,
        )


def warn_if_budget_left(trainer: Any, engine: PrivateStepEngine, stopped_on_budget: bool) -> None:
    """At the end of a fit: a step that spends until its budget is used up was stopped by the Trainer."""
    step = engine.step_slot
    target = engine.target_epsilon
    if stopped_on_budget or target is None or not step.spends_until_budget:
        return
    affordable = engine.affordable_steps()
    if affordable is not None and affordable < 1:
        return
    spent = engine.ledger.epsilon()
    limit = trainer_limit(trainer) or "the Trainer"
    warnings.warn(
        f"{step.name} spends its budget adaptively and stops when it is used up, but {limit} stopped "
        f"training first: ε = {spent:.4g} of target_epsilon = {target:g} spent, ε {target - spent:.3g} left "
        "unused. Let the budget be the stop: Trainer(max_epochs=-1, max_steps=-1) (configs/bank_dpagd.yaml "
        "does this).",
        stacklevel=2,
    )
