"""Private hyperparameter tuning: best of a secret random number K of DP trials, priced as one ledger event.

``tune(base_args, "search.yaml")`` draws K (Poisson, logarithmic, geometric or truncated negative
binomial; :mod:`lightning_dp.accounting.repeat_select`) and K hyperparameter settings i.i.d. from a fixed
search space, all from an ``os.urandom`` generator and before any trial. Every trial is an ordinary
``DPStrategy`` fit, scored by a noisy count; only the best trial's model, score and hyperparameters are
released, with the ε of the WHOLE search (PS22 Thm 2 or 6 on the planned trial curve) in a public report.
K, the number of trials, the other trials and their scores stay in ``<out_dir>/private`` (not for
release). What is and is not covered: docs/tuning.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import shutil
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from lightning_dp.accounting.calibrate import calibrate_noise
from lightning_dp.accounting.events import Gaussian, PoissonGaussian, PrivacyEvent
from lightning_dp.accounting.ledger import PrivacyLedger
from lightning_dp.accounting.rdp import check_delta, epsilon_from_rdp, segment_rdp
from lightning_dp.accounting.repeat_select import (
    FAMILIES,
    RepeatAndSelect,
    Repetitions,
    max_history_rdp,
    repeat_and_select_rdp,
)
from lightning_dp.errors import DPConfigurationError

__all__ = [
    "Choice",
    "LogUniform",
    "Repetitions",
    "Score",
    "SearchSpace",
    "SearchSpec",
    "TrialOutcome",
    "TrialRun",
    "TuningPlan",
    "TuningResult",
    "Uniform",
    "calibrate_tuning",
    "load_search",
    "plan",
    "tune",
]

#: Most privacy-relevant combinations a search may have (each one is planned).
MAX_COMBINATIONS = 1024
_STATE_VERSION = 1
#: Keys a candidate may never set: the strategy seed would make the trials' noise public (I3).
_FORBIDDEN_KEYS = ("trainer.strategy.init_args.seed",)
_BUDGET_KEYS = ("trainer.strategy.init_args.noise_multiplier", "trainer.strategy.init_args.target_epsilon")
SCORE_SOURCES = ("private_validation", "private_train", "public")


# ------------------------------------------------------------------------------------ search space
@dataclass(frozen=True)
class Choice:
    """A hyperparameter drawn uniformly from a finite list (required for keys that change the privacy cost)."""

    values: tuple[Any, ...]

    def __post_init__(self) -> None:
        """Refuse an empty list."""
        object.__setattr__(self, "values", tuple(self.values))
        if not self.values:
            raise ValueError("a choice needs at least one value")

    def sample(self, rng: np.random.Generator) -> Any:
        """One value, uniformly."""
        return self.values[int(rng.integers(len(self.values)))]

    def probe_values(self) -> tuple[Any, ...]:
        """Every value (each is planned)."""
        return self.values


@dataclass(frozen=True)
class Uniform:
    """A real hyperparameter drawn uniformly in [low, high] (only for keys that leave the privacy cost alone)."""

    low: float
    high: float

    def __post_init__(self) -> None:
        """Refuse an empty or reversed interval."""
        if not (math.isfinite(self.low) and math.isfinite(self.high) and self.low < self.high):
            raise ValueError(f"uniform needs finite low < high, got [{self.low}, {self.high}]")

    def sample(self, rng: np.random.Generator) -> float:
        """One value."""
        return float(rng.uniform(self.low, self.high))

    def probe_values(self) -> tuple[float, ...]:
        """Both ends and the midpoint (I6: if they plan differently, the key must be a choice)."""
        return (self.low, 0.5 * (self.low + self.high), self.high)


@dataclass(frozen=True)
class LogUniform(Uniform):
    """A positive real hyperparameter drawn log-uniformly in [low, high] (learning rates)."""

    def __post_init__(self) -> None:
        """Also refuse a non-positive low end."""
        super().__post_init__()
        if self.low <= 0:
            raise ValueError(f"log_uniform needs 0 < low, got {self.low}")

    def sample(self, rng: np.random.Generator) -> float:
        """One value."""
        return float(math.exp(rng.uniform(math.log(self.low), math.log(self.high))))

    def probe_values(self) -> tuple[float, ...]:
        """Both ends and the geometric midpoint."""
        return (self.low, math.sqrt(self.low * self.high), self.high)


Distribution = Choice | Uniform | LogUniform


class SearchSpace:
    """LightningCLI dotted keys (``model.init_args.lr``) mapped to distributions, fixed before tuning starts."""

    def __init__(self, candidates: Mapping[str, Distribution]) -> None:
        """Validate the keys: no strategy seed (I3); at least one key."""
        if not candidates:
            raise ValueError("the search space is empty: give at least one key under 'candidates'")
        for key, dist in candidates.items():
            if key in _FORBIDDEN_KEYS:
                raise DPConfigurationError(
                    f"candidate key {key!r} would fix the trials' noise seed and make it public; remove it "
                    "(each trial draws its noise from os.urandom)"
                )
            if not isinstance(dist, (Choice, Uniform)):
                raise ValueError(f"candidate {key!r} must be a Choice, Uniform or LogUniform, got {dist!r}")
        self.candidates: dict[str, Distribution] = dict(candidates)

    def sample(self, rng: np.random.Generator) -> dict[str, Any]:
        """One setting θ, each key drawn independently (no adaptation to earlier scores: I4)."""
        return {key: _plain(dist.sample(rng)) for key, dist in self.candidates.items()}

    def to_dict(self) -> dict[str, Any]:
        """The YAML form (public: hyperparameter values are not private)."""
        out: dict[str, Any] = {}
        for key, dist in self.candidates.items():
            if isinstance(dist, Choice):
                out[key] = {"choice": list(dist.values)}
            elif isinstance(dist, LogUniform):
                out[key] = {"log_uniform": [dist.low, dist.high]}
            else:
                out[key] = {"uniform": [dist.low, dist.high]}
        return out


def _plain(value: Any) -> Any:
    """numpy scalars → python scalars (JSON and CLI arguments)."""
    return value.item() if isinstance(value, np.generic) else value


def _parse_distribution(key: str, spec: Any) -> Distribution:
    """``{choice: [...]}``, ``{uniform: [a, b]}``, ``{log_uniform: [a, b]}`` or a plain list (a choice)."""
    if isinstance(spec, list):
        return Choice(tuple(spec))
    if isinstance(spec, dict) and len(spec) == 1:
        ((kind, args),) = spec.items()
        if kind == "choice" and isinstance(args, list):
            return Choice(tuple(args))
        if kind in ("uniform", "log_uniform") and isinstance(args, list) and len(args) == 2:
            low, high = float(args[0]), float(args[1])
            return LogUniform(low, high) if kind == "log_uniform" else Uniform(low, high)
    raise ValueError(
        f"candidate {key!r}: expected a list, {{choice: [...]}}, {{uniform: [low, high]}} or "
        f"{{log_uniform: [low, high]}}, got {spec!r}"
    )


@dataclass(frozen=True)
class Score:
    """How a trial is scored; the score is released with the winner, so its noise is priced (docs/tuning.md).

    ``private_validation`` (default): correct predictions on the validation split + N(0, s²), divided by the
    validation size; ``private_train``: the same on the training set; ``public``: noiseless accuracy on a
    validation split that is NOT private data (the user's declaration; it costs nothing).
    """

    source: str = "private_validation"
    metric: str = "accuracy"
    noise_multiplier: float = 10.0

    def __post_init__(self) -> None:
        """Refuse metrics of private data that carry no noise (train_loss, val_acc) and bad noise."""
        if self.source not in SCORE_SOURCES:
            raise DPConfigurationError(
                f"score source {self.source!r} is not covered: a metric logged on private data without noise "
                f"(train_loss, val_acc) leaks it. Use one of {SCORE_SOURCES} (private_validation adds "
                "Gaussian noise to a correct count and is priced in the tuned ε)"
            )
        if self.metric != "accuracy":
            raise DPConfigurationError(
                f"score metric {self.metric!r} is not supported; use metric: accuracy (a count with sensitivity 1)"
            )
        if self.private and not (math.isfinite(self.noise_multiplier) and self.noise_multiplier > 0):
            raise DPConfigurationError(
                f"score noise_multiplier must be > 0 for a private score, got {self.noise_multiplier}; "
                "use e.g. 10.0"
            )

    @property
    def private(self) -> bool:
        """Whether the score reads private data (and so adds a priced Gaussian release)."""
        return self.source != "public"

    def event(self) -> PrivacyEvent | None:
        """The release the score adds to each trial: a Gaussian count (sensitivity 1), or nothing if public."""
        return Gaussian(self.noise_multiplier) if self.private else None


@dataclass(frozen=True)
class SearchSpec:
    """Everything a search fixes in advance: space, law of K, score and budget (I5: not from private data)."""

    space: SearchSpace
    repetitions: Repetitions
    score: Score = field(default_factory=Score)
    target_epsilon: float | None = None
    delta: float | None = None


def load_search(
    source: str | os.PathLike[str] | Mapping[str, Any], *, require_distribution: bool = True
) -> SearchSpec:
    """Read a search YAML (or the dict it holds): ``repetitions``, ``candidates``, ``score``, ``budget``.

    ``require_distribution=False`` (``--plan_only``) reads a file without a law of K as Poisson, only to
    print the ε of every law at its mean.
    """
    if isinstance(source, Mapping):
        data: Any = dict(source)
    else:
        with open(source) as f:
            data = yaml.safe_load(f)
    if not isinstance(data, dict):
        raise ValueError(f"the search file must be a YAML mapping, got {type(data).__name__}")
    unknown = set(data) - {"repetitions", "candidates", "score", "budget"}
    if unknown:
        raise ValueError(
            f"unknown search keys {sorted(unknown)}; expected repetitions, candidates, score, budget"
        )
    reps = data.get("repetitions") or {}
    if isinstance(reps, dict) and "distribution" not in reps and not require_distribution:
        reps = {**reps, "distribution": "poisson"}
    if not isinstance(reps, dict) or "distribution" not in reps:
        raise DPConfigurationError(
            "repetitions.distribution is required and has no default: choose one of "
            f"{FAMILIES} (run `lightning-dp tune --plan_only` to see the ε of each), e.g. "
            "repetitions: {distribution: poisson, mean: 10}"
        )
    try:
        repetitions = Repetitions(
            str(reps["distribution"]), float(reps.get("mean", 0.0)), float(reps.get("eta", 0.0))
        )
    except ValueError as err:
        raise DPConfigurationError(str(err)) from None
    candidates = data.get("candidates")
    if not isinstance(candidates, dict):
        raise ValueError(
            "the search file needs 'candidates': a mapping of LightningCLI keys to distributions"
        )
    space = SearchSpace({str(k): _parse_distribution(str(k), v) for k, v in candidates.items()})
    score_data = data.get("score") or {}
    score = Score(
        source=str(score_data.get("source", "private_validation")),
        metric=str(score_data.get("metric", "accuracy")),
        noise_multiplier=float(score_data.get("noise_multiplier", 10.0)),
    )
    budget = data.get("budget") or {}
    target = budget.get("target_epsilon")
    delta = budget.get("delta")
    if target is not None:
        target = float(target)
        if not (math.isfinite(target) and target > 0):
            raise ValueError(f"budget.target_epsilon must be a finite number > 0, got {target}")
        bad = [k for k in space.candidates if k in _BUDGET_KEYS]
        if bad:
            raise DPConfigurationError(
                f"candidates {bad} set σ or the trial target while budget.target_epsilon calibrates them; remove "
                "one of the two"
            )
    return SearchSpec(space, repetitions, score, target, None if delta is None else check_delta(delta))


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


def _override_args(overrides: Mapping[str, Any]) -> list[str]:
    """``--key=value`` LightningCLI arguments (values as JSON, strings as they are)."""
    return [
        f"--{key}={value if isinstance(value, str) else json.dumps(value)}"
        for key, value in overrides.items()
    ]


def _instantiate(args: Sequence[str]) -> Any:
    """A DPLightningCLI built without running (no config file written)."""
    import lightning_dp
    from lightning_dp.cli import DPLightningCLI

    lightning_dp.register()
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
    from lightning_dp.strategy import DPStrategy

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
    sampler.bind(num_samples, batch_size)
    num_batches = max(1, math.ceil(num_samples / batch_size))
    steps = strategy.planned_steps(trainer, num_batches)
    if engine.noise.is_set or engine.target_epsilon is None:
        sigma = engine.noise.noise_multiplier(0)
    else:  # calibrated exactly as the strategy will (ConstantNoise.calibrate), on a copy
        noise = ConstantNoise(None)
        noise.calibrate(engine.target_epsilon, engine.delta, sampler, steps, engine.accountant)
        sigma = noise.noise_multiplier(0)
    return TrialPlan(sampler.sample_rate, steps, float(sigma), float(engine.delta))


PlanFn = Callable[[Sequence[str], Score], TrialPlan]


def _plan_from_args(args: Sequence[str], score: Score) -> TrialPlan:
    """Instantiate the trial configuration (no logger, no training) and plan it."""
    return _plan_trial(_instantiate([*args, "--trainer.logger=false"]), score)


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
    planner = plan_fn or _plan_from_args
    base = list(base_args)
    base_plan = planner(base, spec.score)
    delta = spec.delta if spec.delta is not None else base_plan.delta
    relevant: list[str] = []
    for key, dist in spec.space.candidates.items():
        probes = {planner(base + _override_args({key: v}), spec.score) for v in dist.probe_values()}
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
    trials = [base_plan if not c else planner(base + _override_args(c), spec.score) for c in combos]
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
    lo = hi
    best: tuple[float, list[float]] | None = None
    while best is None:  # halve until feasible (the floor is below target, so small enough t works)
        lo /= 2
        try:
            eps_lo, sigmas_lo = at(lo)
        except ValueError:  # σ would pass MAX_NOISE_MULTIPLIER: the margin above the floor is too thin
            raise refuse(floor) from None
        if eps_lo <= target_epsilon:
            best = (lo, sigmas_lo)
    lo, sigmas_lo = best
    # Safeguarded regula falsi on ε(t): each step stays inside the middle 80% of the bracket, so it shrinks.
    while hi - lo > tol * hi and eps_lo < target_epsilon * (1 - tol / 2):  # at(lo) meets it, at(hi) does not
        frac = (target_epsilon - eps_lo) / (eps_hi - eps_lo) if math.isfinite(eps_hi) else 0.5
        mid = lo + min(0.9, max(0.1, frac)) * (hi - lo)
        eps_mid, sigmas_mid = at(mid)
        if eps_mid <= target_epsilon:
            lo, eps_lo, sigmas_lo = mid, eps_mid, sigmas_mid
        else:
            hi, eps_hi = mid, eps_mid
    return sigmas_lo, [lo] * len(trials)


# ---------------------------------------------------------------------------------------------- trials
@dataclass(frozen=True)
class TrialRun:
    """What a trial runner gets: the full LightningCLI args, its private directory and the score to compute."""

    args: list[str]
    directory: Path
    score: Score


@dataclass(frozen=True)
class TrialOutcome:
    """What a runner returns: the raw metric (a correct count over ``n``), the realised RDP and a checkpoint."""

    correct: float
    n: int
    rdp: np.ndarray
    orders: tuple[float, ...]
    checkpoint: Path | None


TrialRunner = Callable[[TrialRun], TrialOutcome]


def _count_correct(model: Any, loader: Any) -> tuple[float, int]:
    """Number of (x, y) examples whose argmax prediction is y, and the number of examples (a public size)."""
    import torch

    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in loader:
            correct += int((model(x.to(model.device)).argmax(dim=-1).cpu() == y).sum())
    return float(correct), len(loader.dataset)


def run_lightning_trial(run: TrialRun) -> TrialOutcome:
    """One ordinary DPStrategy fit of ``run.args``, scored on the split its source names (not noised here)."""
    cli = _instantiate(run.args)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    checkpoint = run.directory / "model.ckpt"
    cli.trainer.save_checkpoint(checkpoint)
    datamodule = cli.datamodule
    if run.score.source == "private_train":
        from torch.utils.data import DataLoader

        loader = DataLoader(datamodule.train_dataloader().dataset, batch_size=256)
    else:
        loader = datamodule.val_dataloader()
    correct, n = _count_correct(cli.model, loader)
    ledger = cli.trainer.strategy.ledger
    return TrialOutcome(correct, n, ledger.rdp, tuple(ledger.orders), checkpoint)


def _check_realised(outcome: TrialOutcome, planned: Sequence[tuple[PrivacyEvent, int]]) -> None:
    """I7: the trial's ledger must not exceed its planned training history at any order."""
    orders = tuple(outcome.orders)
    # Priced as the trial's ledger prices a run (segment_rdp: exact from EXACT_RUN equal steps on, a
    # cached upper bound below), so a trial that made exactly the planned releases passes.
    bound = sum((segment_rdp(event, count, orders) for event, count in planned), np.zeros(len(orders)))
    if not np.all(np.asarray(outcome.rdp) <= bound * (1 + 1e-12)):
        raise DPConfigurationError(
            "a trial spent more privacy than its plan (its ledger exceeds the planned history at some order), so "
            "the tuned ε would not hold and nothing is released. Check that no candidate key changes the batch "
            "size, length or noise without being a choice"
        )


# ----------------------------------------------------------------------------------------------- tune
@dataclass
class TuningResult:
    """The public result: ε of the whole search, the selected overrides and score (None if nothing released)."""

    epsilon: float
    delta: float
    order: float
    selected: dict[str, Any] | None
    report_path: Path
    plot_path: Path
    checkpoint: Path | None


def _fingerprint(base_args: Sequence[str], spec: SearchSpec) -> str:
    """SHA-256 of the base args, the files they name (configs) and the search: a resume must match it (I9)."""
    digest = hashlib.sha256()
    for arg in base_args:
        digest.update(arg.encode())
        for part in (arg, arg.split("=", 1)[-1]):
            if os.path.isfile(part):
                digest.update(Path(part).read_bytes())
    search = {
        "candidates": spec.space.to_dict(),
        "repetitions": spec.repetitions.to_dict(),
        "score": vars(spec.score),
        "budget": [spec.target_epsilon, spec.delta],
    }
    digest.update(json.dumps(search, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def _write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (a crash leaves the old file or the new one, never half of one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _new_state(spec: SearchSpec, fingerprint: str, seed: int | None) -> dict[str, Any]:
    """Draw K, θ_1..θ_K, the tie-breakers u_i and the score noises z_i, all before any trial (I1, I3)."""
    rng = np.random.default_rng(seed if seed is not None else int.from_bytes(os.urandom(16), "little"))
    k = spec.repetitions.sample(rng)
    return {
        "version": _STATE_VERSION,
        "fingerprint": fingerprint,
        "seed_given": seed is not None,
        "repetitions": spec.repetitions.to_dict(),
        "K": k,
        "thetas": [spec.space.sample(rng) for _ in range(k)],
        "u": [float(rng.uniform()) for _ in range(k)],
        "z": [float(rng.standard_normal()) for _ in range(k)],
        "trials": [{"status": "pending", "score": None, "checkpoint": None} for _ in range(k)],
    }


def _load_state(path: Path, fingerprint: str, spec: SearchSpec) -> dict[str, Any]:
    """The stored draws (the only source of K, θ, u, z, γ on resume); refuses a changed config or search."""
    with open(path) as f:
        state: dict[str, Any] = json.load(f)
    if state.get("version") != _STATE_VERSION or state.get("fingerprint") != fingerprint:
        raise DPConfigurationError(
            f"{path} was written for another config, search file or score; resuming with a changed setup would "
            "not be covered by the tuned ε. Restore the original files, or start a new search in a new --out_dir"
        )
    if float.fromhex(state["repetitions"]["gamma_hex"]) != spec.repetitions.gamma:
        raise DPConfigurationError(f"{path} stores another γ for K; start a new search in a new --out_dir")
    return state


def _select(state: Mapping[str, Any]) -> int | None:
    """Index of the maximum of (score, u) over the trials, failures and NaN scoring −∞ (I10); None if K = 0."""
    best: tuple[float, float] | None = None
    index = None
    for i, (trial, u) in enumerate(zip(state["trials"], state["u"], strict=True)):
        score = trial["score"]
        value = -math.inf if score is None or math.isnan(score) else float(score)
        if best is None or (value, u) > best:
            best, index = (value, u), i
    if index is None or best is None or best[0] == -math.inf:
        return None
    return index


def tune(
    base_args: Sequence[str],
    search: SearchSpec | str | os.PathLike[str] | Mapping[str, Any],
    *,
    out_dir: str | os.PathLike[str] = "runs/tune",
    resume: bool = False,
    seed: int | None = None,
    runner: TrialRunner | None = None,
    plan_fn: PlanFn | None = None,
    log_release: bool = True,
    ledger: str | os.PathLike[str] | None = None,
) -> TuningResult:
    """Run a private search and release only the best trial; returns ε of the whole search and the winner.

    ``base_args`` are LightningCLI arguments (``["--config", "configs/digits_dpsgd.yaml"]``); ``search`` a
    search YAML/dict/:class:`SearchSpec`. ``seed`` is for tests only: it makes K public (the report says
    ``seed_given``). ``runner``/``plan_fn`` replace the Lightning trial and planner (tests). ``ledger``: a
    JSON file with a ``PrivacyLedger.state_dict()`` of earlier releases on the same data (other searches,
    retraining); the search is recorded into it once, and the report gives the ledger's total ε too.
    """
    spec = search if isinstance(search, SearchSpec) else load_search(search)
    tuning_plan = plan(base_args, spec, plan_fn=plan_fn)
    out = Path(out_dir)
    private, release = out / "private", out / "release"
    state_path = private / "state.json"
    fingerprint = _fingerprint(base_args, spec)
    if resume:
        if not state_path.exists():
            raise DPConfigurationError(
                f"--resume: no search state at {state_path}; drop --resume to start one"
            )
        state = _load_state(state_path, fingerprint, spec)
        if seed is not None:
            warnings.warn("--seed is ignored on --resume: K and θ come from the stored state", stacklevel=2)
    else:
        if state_path.exists():
            raise DPConfigurationError(
                f"{out} already holds a search; pass --resume to finish it, or choose a new --out_dir (a new "
                "draw of K on the same data would be a second, separately priced search)"
            )
        if seed is not None:
            warnings.warn(
                "tune(seed=...) makes K and the hyperparameter draws reproducible, hence public: the tuned ε does "
                "not cover that. Use it for tests only",
                stacklevel=2,
            )
        state = _new_state(spec, fingerprint, seed)
        _write_json(state_path, state)
    run_trial = runner or run_lightning_trial
    score = spec.score
    extra_args = ["--trainer.limit_val_batches=0"] if score.private else []
    for i, trial in enumerate(state["trials"]):
        if trial["status"] in ("done", "failed"):
            continue  # never rerun a finished trial (I9); a failed one still counts (I8)
        theta = state["thetas"][i]
        directory = private / f"trial_{i}"
        if directory.exists():
            shutil.rmtree(directory)  # an interrupted trial restarts from scratch with the same θ
        directory.mkdir(parents=True)
        overrides = tuning_plan.trial_overrides(theta)
        args = [
            *base_args,
            *_override_args(overrides),
            *extra_args,
            "--trainer.enable_progress_bar=false",  # one bar per trial on the console would count K
            f"--trainer.default_root_dir={directory}",
            "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
            f"--trainer.logger.init_args.save_dir={directory}",
        ]
        index = tuning_plan.combination_of(theta)
        planned = tuning_plan.trials[index].history(tuning_plan.sigmas[index])
        try:
            outcome = run_trial(TrialRun(args, directory, score))
        except DPConfigurationError:
            raise
        except Exception as err:  # a crashed trial counts as one of the K and scores −∞ (I8)
            trial.update(status="failed", score=None, error=f"{type(err).__name__}: {err}")
        else:
            _check_realised(outcome, planned)
            noisy = outcome.correct + (score.noise_multiplier * state["z"][i] if score.private else 0.0)
            trial.update(
                status="done",
                score=noisy / max(outcome.n, 1),
                checkpoint=None if outcome.checkpoint is None else str(outcome.checkpoint),
            )
        _write_json(state_path, state)
    return _release(tuning_plan, state, release, log_release, base_args, ledger)


def _release(
    tuning_plan: TuningPlan,
    state: dict[str, Any],
    release: Path,
    log_release: bool,
    base_args: Sequence[str],
    ledger_path: str | os.PathLike[str] | None = None,
) -> TuningResult:
    """Write the public report and plot, copy the winner's checkpoint, log ε to the user's loggers."""
    release.mkdir(parents=True, exist_ok=True)
    ledger = tuning_plan.ledger()
    epsilon, order = ledger.epsilon_and_order()
    winner = _select(state)
    selected = None
    checkpoint = None
    if winner is not None:
        trial = state["trials"][winner]
        if trial["checkpoint"]:
            checkpoint = release / "model.ckpt"
            _public_checkpoint(Path(trial["checkpoint"]), checkpoint)
        selected = {
            "overrides": state["thetas"][winner],
            "score": trial["score"],
            "checkpoint": None if checkpoint is None else checkpoint.name,
        }
    report = tuning_report(tuning_plan, selected, seed_given=bool(state["seed_given"]))
    if ledger_path is not None:
        report["ledger_epsilon"] = _record_in_ledger(tuning_plan, state, Path(ledger_path))
        _write_json(release.parent / "private" / "state.json", state)
    report_path = release / "tuning_report.json"
    _write_json(report_path, report)
    plot_path = release / "tuning_epsilon.png"
    plot_tuning_epsilon(tuning_plan, plot_path)
    if log_release:
        _log_release(base_args, report)
    return TuningResult(
        epsilon, tuning_plan.delta, float(order or math.nan), selected, report_path, plot_path, checkpoint
    )


def _record_in_ledger(tuning_plan: TuningPlan, state: dict[str, Any], path: Path) -> float:
    """Record the search in the project ledger at ``path`` (once, even across resumes); its ε at the plan's δ."""
    ledger = PrivacyLedger(tuning_plan.delta)
    if path.exists():
        with open(path) as f:
            ledger.load_state_dict(json.load(f))
    if not state.get("recorded_in_ledger"):
        ledger.record(tuning_plan.event())
        _write_json(path, ledger.state_dict())
        state["recorded_in_ledger"] = True
    return ledger.epsilon()


#: The DP state a released checkpoint keeps: the ledger and step count are data-independent. The noise and
#: sampling generator states are not released: Mersenne Twister can be run backwards, so a generator's
#: final state would give away every noise draw of the trial.
_PUBLIC_DP_STATE = ("version", "steps", "ledger", "max_grad_norm")


def _public_checkpoint(source: Path, destination: Path) -> None:
    """Copy the winner's checkpoint without its generator states (I13); the weights and hparams are kept."""
    import torch

    checkpoint = torch.load(source, map_location="cpu", weights_only=False)
    state = checkpoint.get("lightning_dp")
    if isinstance(state, dict):
        checkpoint["lightning_dp"] = {k: v for k, v in state.items() if k in _PUBLIC_DP_STATE}
    tmp = destination.with_suffix(".tmp")
    torch.save(checkpoint, tmp)
    os.replace(tmp, destination)


def _naive_epsilon(curve: np.ndarray, orders: tuple[float, ...], k: int, delta: float) -> float:
    """ε of k trials composed and all released (the comparison the report and plot show)."""
    return epsilon_from_rdp(k * curve, orders, delta)[0]


def tuned_epsilon(
    curve: np.ndarray, orders: tuple[float, ...], repetitions: Repetitions, delta: float
) -> float:
    """ε of the best of K ~ ``repetitions`` trials with single-trial RDP ``curve``."""
    return epsilon_from_rdp(repeat_and_select_rdp(curve, orders, repetitions), orders, delta)[0]


def tuning_report(
    tuning_plan: TuningPlan, selected: dict[str, Any] | None, *, seed_given: bool
) -> dict[str, Any]:
    """The public report: ε of the search and how it was computed. No K, no other trial, no trial index (I2)."""
    import lightning_dp

    ledger = tuning_plan.ledger()
    epsilon, order = ledger.epsilon_and_order()
    orders = ledger.orders
    curve = max_history_rdp(tuning_plan.histories(), orders)
    reps = tuning_plan.spec.repetitions
    return {
        "epsilon": epsilon,
        "delta": tuning_plan.delta,
        "rdp_order": order,
        "theorem": reps.theorem,
        "repetitions": reps.to_dict(),
        "epsilon_single_trial": epsilon_from_rdp(curve, orders, tuning_plan.delta)[0],
        "epsilon_naive_at_mean": _naive_epsilon(curve, orders, math.ceil(reps.mean), tuning_plan.delta),
        "target_epsilon": tuning_plan.spec.target_epsilon,
        "search_space": tuning_plan.spec.space.to_dict(),
        "per_candidate": tuning_plan.per_candidate(),
        "selected": selected,
        "score_source": tuning_plan.spec.score.source,
        "score_noise_multiplier": tuning_plan.spec.score.noise_multiplier
        if tuning_plan.spec.score.private
        else None,
        "seed_given": seed_given,
        "lightning_dp_version": lightning_dp.__version__,
    }


def epsilon_by_mean(tuning_plan: TuningPlan, means: Sequence[float]) -> dict[str, list[float]]:
    """Tuned ε of the planned trial curve for every family at each mean (data-independent: the plot, --plan_only)."""
    orders = PrivacyLedger(tuning_plan.delta).orders
    curve = max_history_rdp(tuning_plan.histories(), orders)
    eta = tuning_plan.spec.repetitions.eta
    out: dict[str, list[float]] = {}
    for family in ("poisson", "logarithmic", "geometric", "tnb"):
        if family == "tnb" and tuning_plan.spec.repetitions.family != "tnb":
            continue
        row = []
        for mean in means:
            if (family == "poisson" and mean < 1) or (family != "poisson" and mean <= 1):
                row.append(math.nan)
                continue
            row.append(tuned_epsilon(curve, orders, Repetitions(family, mean, eta), tuning_plan.delta))
        out[family] = row
    out["naive"] = [
        _naive_epsilon(curve, orders, int(m), tuning_plan.delta) if float(m).is_integer() else math.nan
        for m in means
    ]
    return out


def plan_summary(tuning_plan: TuningPlan) -> str:
    """Text table for ``--plan_only``: ε of one trial per combination, and the search's ε for each law of K."""
    reps = tuning_plan.spec.repetitions
    lines = [f"privacy-relevant keys: {tuning_plan.relevant_keys or 'none'}"]
    for row in tuning_plan.per_candidate():
        lines.append(
            f"  {row['overrides'] or '(every setting)'}: σ = {row['noise_multiplier']:.6g}, q = {row['sample_rate']:.6g}, "
            f"{row['steps']} steps, ε of one trial = {row['epsilon']:.4f}"
        )
    table = epsilon_by_mean(tuning_plan, [reps.mean])
    lines.append(f"ε of the released best at mean {reps.mean:g} trials (δ = {tuning_plan.delta:g}):")
    for family, (value,) in table.items():
        name = f"naive composition of {reps.mean:g}" if family == "naive" else family
        lines.append(f"  {name}: {value:.4f}" + ("  <- configured" if family == reps.family else ""))
    return "\n".join(lines)


def plot_tuning_epsilon(tuning_plan: TuningPlan, path: Path) -> None:
    """ε against the mean number of trials (chosen family solid, others dashed, naive composition, single
    trial, target, configured mean). No point per executed trial: that would reveal K (I2)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reps = tuning_plan.spec.repetitions
    means = [float(m) for m in np.unique(np.round(np.geomspace(1.0, 100.0, 25)))] + [1.5, 2.5]
    means = sorted({*means, reps.mean})
    table = epsilon_by_mean(tuning_plan, means)
    orders = PrivacyLedger(tuning_plan.delta).orders
    single = epsilon_from_rdp(max_history_rdp(tuning_plan.histories(), orders), orders, tuning_plan.delta)[0]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for family, row in table.items():
        if family == "naive":
            ks = [m for m, v in zip(means, row, strict=True) if math.isfinite(v)]
            ax.plot(ks, [v for v in row if math.isfinite(v)], "k.", label="naive composition of k trials")
            continue
        style = "-" if family == reps.family else "--"
        ax.plot(means, row, style, label=f"best of K, K ~ {family}")
    ax.axhline(single, color="grey", lw=0.8, label="one trial")
    if tuning_plan.spec.target_epsilon is not None:
        ax.axhline(tuning_plan.spec.target_epsilon, color="red", lw=0.8, label="target")
    ax.axvline(reps.mean, color="grey", ls=":", label="configured mean")
    ax.set_xscale("log")
    ax.set_xlabel("mean number of trials")
    ax.set_ylabel(f"ε at δ = {tuning_plan.delta:g}")
    ax.set_title("ε of the released best trial")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _log_release(base_args: Sequence[str], report: Mapping[str, Any]) -> None:
    """Send the search's ε and the selected setting to every logger of the base config (one run, no trial)."""
    cli = _instantiate(base_args)
    selected = report["selected"] or {}
    metrics = {"tune/epsilon": float(report["epsilon"]), "tune/delta": float(report["delta"])}
    if selected.get("score") is not None:
        metrics["tune/score"] = float(selected["score"])
    for logger in cli.trainer.loggers:
        with contextlib.suppress(NotImplementedError):
            logger.log_hyperparams({"tune/" + k: v for k, v in (selected.get("overrides") or {}).items()})
        logger.log_metrics(metrics, step=0)
        logger.save()
        logger.finalize("success")
