"""Planning a private search before any trial: each combination's ledger events and the search's ε (PS22)."""

from __future__ import annotations

import itertools
import json
import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_dp.accounting.calibrate import calibrate_noise
from lightning_dp.accounting.events import PoissonGaussian, PrivacyEvent
from lightning_dp.accounting.ledger import PrivacyLedger
from lightning_dp.accounting.rdp import epsilon_from_rdp
from lightning_dp.accounting.repeat_select import (
    RepeatAndSelect,
    Repetitions,
    max_history_rdp,
    repeat_and_select_rdp,
)
from lightning_dp.commands.tuning.space import MAX_COMBINATIONS, Choice, Score, SearchSpec, load_search
from lightning_dp.core.errors import DPConfigurationError


# -------------------------------------------------------------------------------------------- planning
@dataclass(frozen=True)
class TrialPlan:
    """The data-independent privacy history of one complete fit: T steps of PoissonGaussian(σ, q)."""

    sample_rate: float
    steps: int
    noise_multiplier: float
    delta: float

    def history(self, noise_multiplier: float | None = None) -> list[tuple[PrivacyEvent, int]]:
        """``[(PoissonGaussian(σ, q), T)]``, at the planned σ or the one given."""
        sigma = self.noise_multiplier if noise_multiplier is None else noise_multiplier
        return [(PoissonGaussian(sigma, self.sample_rate), self.steps)]


def override_args(overrides: Mapping[str, Any]) -> list[str]:
    """``--key=value`` LightningCLI arguments (values as JSON, strings as they are)."""
    return [
        f"--{key}={value if isinstance(value, str) else json.dumps(value)}"
        for key, value in overrides.items()
    ]


def instantiate_cli(args: Sequence[str]) -> Any:
    """A DPLightningCLI built without running (no config file written)."""
    from lightning_dp.commands.lightning_cli import DPLightningCLI
    from lightning_dp.strategies import register

    register()
    with (
        warnings.catch_warnings()
    ):  # `lightning-dp tune` passes the trial's args while sys.argv holds the tuner's
        warnings.filterwarnings("ignore", ".*args parameter is intended to run from within Python.*")
        return DPLightningCLI(
            args=list(args), run=False, save_config_callback=None, auto_configure_optimizers=False
        )


def _plan_trial(cli: Any, score: Score) -> TrialPlan:
    """Plan one fit from an instantiated CLI, refusing what version 1 cannot plan (before any training)."""
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    from lightning_dp.clipping import FlatClipping
    from lightning_dp.noise import ConstantNoise
    from lightning_dp.sampling import Poisson
    from lightning_dp.slots import Step
    from lightning_dp.strategies import DPStrategy

    trainer = cli.trainer
    strategy = trainer.strategy
    if type(strategy) is not DPStrategy:
        raise DPConfigurationError(
            f"tune plans DPStrategy trials only, got {type(strategy).__name__}; use "
            "trainer.strategy: {class_path: lightning_dp.DPStrategy, ...}"
        )
    engine = strategy.engine
    kinds = (type(engine.sampler), type(engine.noise), type(engine.clipping), type(engine.step_slot))
    if kinds != (Poisson, ConstantNoise, FlatClipping, Step):
        raise DPConfigurationError(
            f"tune version 1 plans only Poisson sampling, constant noise, flat clipping and the default Step, "
            f"got {[k.__name__ for k in kinds]}; use the defaults of DPStrategy"
        )
    if engine.accountant != "rdp":
        raise DPConfigurationError(
            f"tune prices trials with RDP (PS22), but the strategy uses accountant={engine.accountant!r}; "
            "set trainer.strategy.init_args.accountant: rdp"
        )
    if score.private:
        monitored = [
            type(c).__name__
            for c in trainer.callbacks
            if isinstance(c, EarlyStopping) or (isinstance(c, ModelCheckpoint) and c.monitor is not None)
        ]
        if monitored:
            raise DPConfigurationError(
                f"callbacks {monitored} monitor a metric of private data, which the tuner does not price; remove "
                "them (the tuner scores each trial with a noisy count, score.source: private_validation)"
            )
    datamodule = cli.datamodule
    if datamodule is not None:
        datamodule.setup("fit")
        loader = datamodule.train_dataloader()
    else:
        loader = cli.model.train_dataloader()
    num_samples, batch_size = len(loader.dataset), loader.batch_size
    sampler = Poisson()
    sampler.public_size = engine.sampler.public_size  # dataset_size=: q and the steps read the declared N
    sampler.bind(num_samples, batch_size)
    num_batches = sampler.batches_per_epoch(num_samples, batch_size)
    steps = strategy.planned_steps(trainer, num_batches)
    if engine.noise.is_set or engine.target_epsilon is None:
        sigma = engine.noise.noise_multiplier(0)
    else:  # calibrated exactly as the strategy will (ConstantNoise.calibrate), on a copy
        noise = ConstantNoise(None)
        noise.calibrate(engine.target_epsilon, engine.delta, sampler, steps, engine.accountant)
        sigma = noise.noise_multiplier(0)
    return TrialPlan(sampler.sample_rate, steps, float(sigma), float(engine.delta))


PlanFn = Callable[[Sequence[str], Score], TrialPlan]


def plan_from_args(args: Sequence[str], score: Score) -> TrialPlan:
    """Instantiate the trial configuration (no logger, no training) and plan it."""
    return _plan_trial(instantiate_cli([*args, "--trainer.logger=false"]), score)


@dataclass
class TuningPlan:
    """The priced plan of a search: every privacy-relevant combination, its σ, and ε of the released best."""

    spec: SearchSpec
    delta: float
    relevant_keys: list[str]
    combinations: list[dict[str, Any]]
    trials: list[TrialPlan]
    sigmas: list[float]
    trial_targets: list[float | None]

    def histories(self) -> list[list[tuple[PrivacyEvent, int]]]:
        """Planned history of each combination, the score's release included."""
        score_event = self.spec.score.event()
        extra = [(score_event, 1)] if score_event is not None else []
        return [t.history(s) + extra for t, s in zip(self.trials, self.sigmas, strict=True)]

    def event(self) -> RepeatAndSelect:
        """The ledger event of the whole search."""
        return RepeatAndSelect.of(self.histories(), self.spec.repetitions)

    def ledger(self) -> PrivacyLedger:
        """A ledger at the user's δ that has recorded the search."""
        ledger = PrivacyLedger(self.delta)
        ledger.record(self.event())
        return ledger

    @property
    def epsilon(self) -> float:
        """ε of the released best trial (the whole search) at :attr:`delta`."""
        return self.ledger().epsilon()

    def combination_of(self, theta: Mapping[str, Any]) -> int:
        """Index of the planned combination a drawn setting θ belongs to."""
        key = {k: theta[k] for k in self.relevant_keys}
        return self.combinations.index(key)

    def trial_overrides(self, theta: Mapping[str, Any]) -> dict[str, Any]:
        """θ plus, in budget mode, the calibrated σ and trial target of its combination."""
        out = dict(theta)
        index = self.combination_of(theta)
        if self.trial_targets[index] is not None:
            out["trainer.strategy.init_args.noise_multiplier"] = self.sigmas[index]
            out["trainer.strategy.init_args.target_epsilon"] = self.trial_targets[index]
        return out

    def per_candidate(self) -> list[dict[str, Any]]:
        """Public per-combination summary: overrides, σ, q, steps and the ε of one trial."""
        rows = []
        for combo, trial, sigma, history in zip(
            self.combinations, self.trials, self.sigmas, self.histories(), strict=True
        ):
            ledger = PrivacyLedger(self.delta)
            for event, count in history:
                ledger.record(event, count)
            rows.append(
                {
                    "overrides": combo,
                    "noise_multiplier": sigma,
                    "sample_rate": trial.sample_rate,
                    "steps": trial.steps,
                    "epsilon": ledger.epsilon(),
                }
            )
        return rows


def plan(
    base_args: Sequence[str],
    search: SearchSpec | str | os.PathLike[str] | Mapping[str, Any],
    *,
    plan_fn: PlanFn | None = None,
) -> TuningPlan:
    """Plan and price a search without training: which keys change the privacy cost, σ per combination, ε.

    Each key is probed at every choice (continuous keys at both ends and the midpoint) with the others at
    the base config; a continuous key whose probes plan differently is refused (I6). The combinations of
    the privacy-relevant keys are then planned one by one.
    """
    spec = search if isinstance(search, SearchSpec) else load_search(search)
    planner = plan_fn or plan_from_args
    base = list(base_args)
    base_plan = planner(base, spec.score)
    delta = spec.delta if spec.delta is not None else base_plan.delta
    relevant: list[str] = []
    for key, dist in spec.space.candidates.items():
        probes = {planner(base + override_args({key: v}), spec.score) for v in dist.probe_values()}
        if len(probes) > 1 or probes != {base_plan}:
            if not isinstance(dist, Choice):
                raise DPConfigurationError(
                    f"key {key} changes the privacy cost; give it as a choice (each value is then planned)"
                )
            relevant.append(key)
    values = [spec.space.candidates[k].probe_values() for k in relevant]
    combos = [dict(zip(relevant, combo, strict=True)) for combo in itertools.product(*values)]
    if len(combos) > MAX_COMBINATIONS:
        raise DPConfigurationError(
            f"the search has {len(combos)} privacy-relevant combinations (keys {relevant}); at most "
            f"{MAX_COMBINATIONS} can be planned. Give fewer choices for these keys"
        )
    trials = [base_plan if not c else planner(base + override_args(c), spec.score) for c in combos]
    result = TuningPlan(
        spec, delta, relevant, combos, trials, [t.noise_multiplier for t in trials], [None] * len(trials)
    )
    if spec.target_epsilon is not None:
        sigmas, targets = calibrate_tuning(
            spec.target_epsilon, delta, trials, spec.repetitions, score_event=spec.score.event()
        )
        result.sigmas, result.trial_targets = sigmas, list(targets)
    return result


def calibrate_tuning(
    target_epsilon: float,
    delta: float,
    trials: Sequence[TrialPlan],
    repetitions: Repetitions,
    *,
    score_event: PrivacyEvent | None = None,
    tol: float = 0.01,
) -> tuple[list[float], list[float]]:
    """Per-combination σ so that the released best of K trials meets ``target_epsilon`` for the whole search.

    Searches a per-trial target t ∈ (0, target] (bracketing, then safeguarded regula falsi): σ_c(t) = calibrate_noise(t, q_c, T_c), then the tuned ε of
    the max curve (score release included). Keeps the largest t whose computed tuned ε is ≤ target (the
    tuned ε grows with every ε_c(λ), which shrinks as σ grows). Returns (σ per combination, t per
    combination); raises DPConfigurationError if no t meets the target.
    """
    extra = [(score_event, 1)] if score_event is not None else []

    def at(t: float) -> tuple[float, list[float]]:
        sigmas = [
            calibrate_noise(
                target_epsilon=t, delta=delta, sample_rate=p.sample_rate, steps=p.steps, tol=tol / 10
            )
            for p in trials
        ]
        event = RepeatAndSelect.of(
            [p.history(s) + extra for p, s in zip(trials, sigmas, strict=True)], repetitions
        )
        ledger = PrivacyLedger(delta)
        ledger.record(event)
        return ledger.epsilon(), sigmas

    def refuse(floor: float) -> DPConfigurationError:
        return DPConfigurationError(
            f"no per-trial budget meets total target_epsilon={target_epsilon:g} at delta={delta:g} with "
            f"{repetitions.family} mean {repetitions.mean:g} trials: the law of K and the score's release alone "
            f"cost ε = {floor:.4g}. Raise the target, lower the mean number of trials, or add noise to the score"
        )

    orders = PrivacyLedger(delta).orders
    free = max_history_rdp([extra], orders) if extra else np.zeros(len(orders))
    floor = tuned_epsilon(free, orders, repetitions, delta)  # trials that cost nothing (σ → ∞)
    if floor >= target_epsilon:
        raise refuse(floor)
    hi = float(target_epsilon)
    eps_hi, sigmas_hi = at(hi)
    if eps_hi <= target_epsilon:
        return sigmas_hi, [hi] * len(trials)
    lo, eps_lo, sigmas_lo = _halve_until_feasible(at, hi, target_epsilon, lambda: refuse(floor))
    lo, sigmas_lo = _regula_falsi(at, target_epsilon, tol, lo, eps_lo, sigmas_lo, hi, eps_hi)
    return sigmas_lo, [lo] * len(trials)


Pricing = Callable[[float], tuple[float, list[float]]]
"""A per-trial target t → (the tuned ε of the whole search, σ per combination)."""


def _halve_until_feasible(
    at: Pricing, hi: float, target: float, refusal: Callable[[], DPConfigurationError]
) -> tuple[float, float, list[float]]:
    """(t, ε, σs) at the first t = hi/2, hi/4, … whose tuned ε meets ``target`` (the floor is below target, so
    a small enough t does); ``refusal()`` is raised when σ would pass ``MAX_NOISE_MULTIPLIER`` first."""
    lo = hi
    while True:
        lo /= 2
        try:
            eps_lo, sigmas_lo = at(lo)
        except ValueError:  # σ would pass MAX_NOISE_MULTIPLIER: the margin above the floor is too thin
            raise refusal() from None
        if eps_lo <= target:
            return lo, eps_lo, sigmas_lo


def _regula_falsi(
    at: Pricing,
    target: float,
    tol: float,
    lo: float,
    eps_lo: float,
    sigmas_lo: list[float],
    hi: float,
    eps_hi: float,
) -> tuple[float, list[float]]:
    """The largest t found (and its σs) whose tuned ε meets ``target``, from a bracket [lo, hi] where ``lo``
    meets it and ``hi`` does not: safeguarded regula falsi on ε(t), each step inside the middle 80% of the
    bracket, so it shrinks, until it is within ``tol`` or ε(lo) within ``tol / 2`` of the target."""
    while hi - lo > tol * hi and eps_lo < target * (1 - tol / 2):  # at(lo) meets it, at(hi) does not
        frac = (target - eps_lo) / (eps_hi - eps_lo) if math.isfinite(eps_hi) else 0.5
        mid = lo + min(0.9, max(0.1, frac)) * (hi - lo)
        eps_mid, sigmas_mid = at(mid)
        if eps_mid <= target:
            lo, eps_lo, sigmas_lo = mid, eps_mid, sigmas_mid
        else:
            hi, eps_hi = mid, eps_mid
    return lo, sigmas_lo


def naive_epsilon(curve: np.ndarray, orders: tuple[float, ...], k: int, delta: float) -> float:
    """ε of k trials composed and all released (the comparison the report and plot show)."""
    return epsilon_from_rdp(k * curve, orders, delta)[0]


def tuned_epsilon(
    curve: np.ndarray, orders: tuple[float, ...], repetitions: Repetitions, delta: float
) -> float:
    """ε of the best of K ~ ``repetitions`` trials with single-trial RDP ``curve``."""
    return epsilon_from_rdp(repeat_and_select_rdp(curve, orders, repetitions), orders, delta)[0]
