"""The search of a private tuning run: the space of hyperparameters, the score and the YAML that declares them."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import yaml

from lightning_dp.accounting.events import Gaussian, PrivacyEvent
from lightning_dp.accounting.rdp import check_delta
from lightning_dp.accounting.repeat_select import (
    FAMILIES,
    Repetitions,
)
from lightning_dp.core.errors import DPConfigurationError

MAX_COMBINATIONS = 1024
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
    target, delta = _budget(data.get("budget") or {}, space)
    return SearchSpec(space, repetitions, score, target, delta)


def _budget(budget: Mapping[str, Any], space: SearchSpace) -> tuple[float | None, float | None]:
    """The search file's ``budget``: (target ε of the whole search, δ), each None when not given; a target
    refuses candidates that set σ or the trial target, which it calibrates."""
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
    return target, None if delta is None else check_delta(delta)
