"""The run's privacy unit, built at set-up: the bounded training set (ELS), the ``PrivacyUnit`` and the
fit-start line that says what the ε covers (``docs/user-level.md``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.core.privacy_unit import PrivacyUnit
from lightning_dp.engine import PrivateStepEngine
from lightning_dp.sampling.contribution_bound import ContributionBound
from lightning_dp.sampling.user_ids import UserIds, UserKey, changed_users_message, same_users
from lightning_dp.sampling.user_poisson import UserPoisson
from lightning_dp.strategies.config import PrivacyConfig


class BoundedData:
    """The training set an example-level run with ``max_examples_per_user`` trains on: at most k examples
    per user; a loader set up again on the same data and ids reuses it."""

    def __init__(self) -> None:
        self._source: Any = None
        self._bounded: Any = None
        self._users: UserIds | None = None
        """The ids the bounded set was made from (read again at every set-up: an in-place edit is found)."""
        self.dataset: Any = None
        """The training set the run samples from, as last returned by :meth:`of`."""
        self.user_key: UserKey | None = None
        """Read the users from this key instead of the config's (see :func:`users_from`)."""

    def of(self, config: PrivacyConfig, dataset: Any, user_level: bool) -> Any:
        """``dataset`` itself, or its bounded subset for example-level runs that declare a bound (user-level
        runs cap inside ``UserPoisson``, over the same choice)."""
        option = config.user_bound
        if option is None or user_level:
            self.dataset = dataset
            return dataset
        key = self.user_key if self.user_key is not None else option.user_key
        bound = ContributionBound(key, option.max_examples_per_user, config.seed)
        bounded = bound.apply(dataset, owner=config.owner)  # the ids are read again, by content
        assert bound.users is not None
        changed = self._users is not None and not same_users(self._users, bound.users)
        if changed and config.checks.data_changes != "public":
            raise DPConfigurationError(changed_users_message(config.owner))
        if self._users is None or changed or dataset is not self._source:
            self._bounded, self._source, self._users = bounded, dataset, bound.users
        self.dataset = self._bounded
        return self.dataset


def user_key_of(strategy: Any) -> UserKey | None:
    """Where the run reads each example's user: the ``UserPoisson`` slot's key, else the ``UserBound``'s
    (None: the run has no users)."""
    sampler, option = strategy.engine.sampler, strategy.config.user_bound
    if isinstance(sampler, UserPoisson):
        return sampler.user_key
    return option.user_key if option is not None else None


@contextmanager
def users_from(strategy: Any, key: UserKey) -> Iterator[None]:
    """The fits inside read each example's user from ``key`` instead of the run's ``user_key``; the run's key
    is restored on exit. The one way to train on a training set the key was not written for (an audit's: the
    real examples, then canary users); a normal run never enters it."""
    sampler, bounded = strategy.engine.sampler, strategy._bounded
    saved = sampler.user_key if isinstance(sampler, UserPoisson) else None
    if isinstance(sampler, UserPoisson):
        sampler.user_key = key
    bounded.user_key = key
    try:
        yield
    finally:
        bounded.user_key = None
        if isinstance(sampler, UserPoisson):
            sampler.user_key = saved


def privacy_unit_of(config: PrivacyConfig, engine: PrivateStepEngine) -> PrivacyUnit:
    """The unit the bound sampler prices: N examples, or U users with k rows each per step."""
    sampler = engine.sampler
    user = sampler.unit == "user"
    return PrivacyUnit(
        kind="user" if user else "example",
        num_units=int(sampler.size_for_releases),  # the declared N (dataset_size=), else the real one
        examples_per_user=getattr(sampler, "examples_per_user", None) if user else None,
        max_examples_per_user=getattr(sampler, "max_examples_per_user", None)
        if user
        else (config.user_bound.max_examples_per_user if config.user_bound is not None else None),
        augmentation_multiplicity=int(getattr(config, "augmentation_multiplicity", 1) or 1),
    )


def fit_start_line(unit: PrivacyUnit, engine: PrivateStepEngine) -> str:
    """One line: the unit, U or N, q and σ per unit, and which knobs are public (none are data statistics)."""
    sampler = engine.sampler
    sigma = engine.noise.noise_multiplier(0) if engine.noise.is_set and not sampler.schedules_noise else None
    budget = f"ε={engine.target_epsilon:g}" if engine.target_epsilon is not None else "the ledger's ε"
    noise = f"σ={sigma:.4g} for {budget}" if sigma is not None else f"noise for {budget}"
    rate = f"q={sampler.sample_rate:.4g} ({sampler.expected_batch_size:g} {unit.kind}s/step)"
    if unit.kind == "user":
        selection = getattr(sampler, "reduction", "mean")
        return (
            f"lightning-dp: user-level DP over {unit.num_units} users (≤{unit.examples_per_user} examples each, "
            f"{selection} then clip), {rate}, {noise} (δ={engine.delta:g}) per user; k and users_per_step are public"
        )
    line = (
        f"lightning-dp: example-level DP over {unit.num_units} examples ({unit.adjacency}), {rate}, {noise} "
        f"(δ={engine.delta:g}) per example"
    )
    if unit.max_examples_per_user is not None:
        line += (
            f"; at most {unit.max_examples_per_user} examples per user (enforced): the report adds a "
            "user-level ε by group privacy"
        )
    return line
