"""The option objects a strategy takes beside its slots: ``checks=Checks(...)`` and ``user_bound=UserBound(...)``.

Each groups settings that belong together, is frozen (a run's settings do not change once it is built) and
validates itself, so :class:`~lightning_dp.strategies.PrivacyConfig` holds one field for each. jsonargparse
reads them as nested groups: ``checks: {sensitivity: every_step}`` under a strategy's ``init_args``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from lightning_dp.checks import DEFAULT_OVERHEAD, CheckSetting
from lightning_dp.core import validation
from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.sampling.user_ids import UserKey

DataChanges = Literal["refuse", "public"]
"""What a change of the training set between epochs does: ``"refuse"`` it (the default), or price each
epoch's N and q as they come, the user declaring that no private data chose them (``"public"``)."""


@dataclass(frozen=True)
class Checks:
    """The run-time checks' settings (``docs/guarantees.md``): ``DPStrategy(checks=Checks(...))``.

    Args:
        sensitivity: refuse a loss, forward or hook that mixes examples, before the release it would break:
            the user's step is run again on the real batch with examples removed or replaced, on the first
            batch and on random later ones within ``overhead`` of the training time; ``"every_step"`` checks
            every batch (audits). Turn off (False) only for a verified model.
        overhead: the time the sampled checks may add, as a share of the training time without them
            (default 0.05: a fit takes about 1.05 times as long as with the checks off; the first batch's
            check always runs, so a fit of a few steps takes longer).
        isolate_examples: run each example through ``training_step`` alone (one forward and backward per
            example), so no loss or forward can mix examples by construction; slower. With users or
            ``augmentation_multiplicity`` > 1, each unit (a user's rows, an example's views) runs alone.
        public_buffers: names (or fnmatch patterns) of buffers written between steps or in forward from the
            weights, the step count or public constants only (an EMA of the weights); others are refused.
        data_changes: ``"refuse"`` (default) refuses a train loader whose data set, N or batch size changes
            between epochs (``reload_dataloaders_every_n_epochs``, a curriculum), before the next release:
            such a change read from private data is released without noise. ``"public"`` declares that no
            private data decides the change (a fixed schedule); each epoch's q is priced.
    """

    sensitivity: CheckSetting = True
    overhead: float = DEFAULT_OVERHEAD
    isolate_examples: bool = False
    public_buffers: Sequence[str] = ()
    data_changes: DataChanges = "refuse"

    def __post_init__(self) -> None:
        owner = "Checks"
        object.__setattr__(self, "public_buffers", tuple(self.public_buffers or ()))
        if self.sensitivity != "every_step":
            validation.flag(self.sensitivity, "sensitivity", owner=owner)
        validation.number(self.overhead, "overhead", owner=owner, low=0, high=1, low_open=True)
        validation.flag(self.isolate_examples, "isolate_examples", owner=owner)
        if not all(isinstance(name, str) for name in self.public_buffers):
            raise DPConfigurationError(f"{owner}: public_buffers must be buffer names or patterns (strings).")
        if self.data_changes not in ("refuse", "public"):
            raise DPConfigurationError(
                f"{owner}: data_changes must be 'refuse' or 'public', got {self.data_changes!r}."
            )


@dataclass(frozen=True)
class UserBound:
    """At most ``max_examples_per_user`` examples per user, enforced: a user-level ε line for an
    example-level run (``docs/user-level.md``). For user-level DP itself, sample users: ``sampler=UserPoisson(...)``.

    Args:
        user_key: where each example's user id is: a column, attribute or item-key name, a sequence or tensor
            of ids aligned with the dataset's indices, or a callable index -> id.
        max_examples_per_user: k: a user with more examples keeps k of them (a seeded per-user choice); the
            report adds a user-level ε by group privacy over k examples. A public hyperparameter.
    """

    user_key: UserKey
    max_examples_per_user: int

    def __post_init__(self) -> None:
        owner = "UserBound"
        if self.user_key is None:
            raise DPConfigurationError(
                f"{owner}: user_key=None: the bound needs to know whose each example is (a column or attribute "
                "name, ids aligned with the dataset's indices, or a function of the index)."
            )
        validation.number(
            self.max_examples_per_user, "max_examples_per_user", owner=owner, low=1, integer=True
        )
