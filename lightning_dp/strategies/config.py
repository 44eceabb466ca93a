"""PrivacyConfig: the privacy arguments of both strategies, validated once and turned into the engine.

``DPStrategy`` and ``DPDDPStrategy`` keep flat keyword arguments (LightningCLI and jsonargparse read a
class's signature for YAML) and hand them here in one piece, so the checks and the defaults live in one
place; ``tests/strategies/test_config.py`` keeps the two signatures and this class in step.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from lightning_dp import validation
from lightning_dp.clipping import AutoClipping, FlatClipping
from lightning_dp.clipping.integer_grid import GridClipping
from lightning_dp.engine import PrivateStepEngine
from lightning_dp.errors import DPConfigurationError
from lightning_dp.noise import ConstantNoise
from lightning_dp.noise.discrete_gaussian import DiscreteGaussian
from lightning_dp.per_example import GradMode
from lightning_dp.prepare import OnBatchNorm
from lightning_dp.sampling import Poisson, UserPoisson
from lightning_dp.sampling.dpis import DPIS
from lightning_dp.sampling.user_ids import UserKey
from lightning_dp.slots import Clipping, Noise, Sampler, Step
from lightning_dp.steps.dp_agd import AdaptiveGD
from lightning_dp.steps.line_search import LineSearch
from lightning_dp.strategies.refusals import refuse_with_users
from lightning_dp.validation import number

DEFAULT_TARGET_EPSILON = 3.0
Accountant = Literal["rdp", "prv", "pld", "pure"]
PrivacyUnitKind = Literal["example", "user"]
"""What one neighbouring data set adds or removes: one example (default) or one user with all their examples."""
DataChanges = Literal["refuse", "public"]
"""What a change of the training set between epochs does: ``"refuse"`` it (the default), or price each
epoch's N and q as they come, the user declaring that no private data chose them (``"public"``)."""


@dataclass(frozen=True)
class PrivacyConfig:
    """What a private run promises and how it is built: the budget, C, the accountant and the four slots.

    A slot left as None is the default (Poisson sampling, flat L2 clipping, constant σ, the user's
    optimizer); ``target_epsilon`` defaults to 3 when neither it nor a noise level is given. Each field is
    the :class:`~lightning_dp.DPStrategy` argument of the same name, documented there.
    """

    target_epsilon: float | None = None
    delta: float = 1e-5
    max_grad_norm: float = 1.0
    noise_multiplier: float | None = None
    accountant: Accountant = "rdp"
    sampler: Sampler | None = None
    clipping: Clipping | None = None
    noise: Noise | None = None
    step: Step | None = None
    on_batchnorm: OnBatchNorm = "raise"
    loss_reduction: Literal["mean", "sum"] = "mean"
    seed: int | None = None
    max_physical_batch_size: int | None = None
    grad_sample_mode: GradMode = "auto"
    check_sensitivity: bool | Literal["every_step"] = True
    check_overhead: float = 0.05
    isolate_examples: bool = False
    public_buffers: Sequence[str] = ()
    data_changes: DataChanges = "refuse"
    augmentation_multiplicity: int = 1
    """K augmented views of each example, averaged before the clip (De et al. 2022); ε unchanged."""
    privacy_unit: PrivacyUnitKind = "example"
    user_key: UserKey | None = None
    examples_per_user: int | None = None
    users_per_step: int | None = None
    unit_selection: Literal["random", "cycle"] = "random"
    unit_reduction: Literal["mean", "sum"] = "mean"
    max_examples_per_user: int | None = None
    secure: bool = False
    """Secure noise: integer sums and discrete Gaussian noise from ``os.urandom`` (``DiscreteGaussian``)."""
    dataset_size: int | None = None
    """N (U with users) declared public: q, the divisor and the epoch length read it, never the real size."""
    owner: str = dataclasses.field(default="DPStrategy", compare=False)
    """The class named in error messages."""
    sigma_calibrated: ClassVar[bool] = False
    """Set per config: True when no σ was given, so it is calibrated from ``target_epsilon`` (from N and q)."""

    @classmethod
    def parameters(cls) -> tuple[str, ...]:
        """The privacy arguments a strategy's ``__init__`` takes (every field but ``owner``)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "owner")

    @classmethod
    def pick(cls, arguments: Mapping[str, Any], owner: str) -> PrivacyConfig:
        """The config from a strategy's ``__init__`` arguments (its ``locals()``); the rest are Lightning's."""
        return cls(**{name: arguments[name] for name in cls.parameters()}, owner=owner)

    def __post_init__(self) -> None:
        object.__setattr__(self, "public_buffers", tuple(self.public_buffers or ()))
        _validate(self)
        _validate_unit(self)
        no_noise_given = self.noise_multiplier is None and (self.noise is None or not self.noise.is_set)
        object.__setattr__(self, "sigma_calibrated", no_noise_given)
        if self.target_epsilon is None and no_noise_given:
            object.__setattr__(self, "target_epsilon", DEFAULT_TARGET_EPSILON)
        if self.noise_multiplier == 0:
            warnings.warn("noise_multiplier=0 adds no noise: this run has no privacy (ε = ∞).", stacklevel=5)

    @property
    def is_secure(self) -> bool:
        """Whether the run uses secure noise (``secure=True``, or a ``DiscreteGaussian`` noise slot)."""
        return self.secure or isinstance(self.noise, DiscreteGaussian)

    def build_engine(self) -> PrivateStepEngine:
        """The engine with this config's slots (defaults filled in), budget and clipping bound."""
        sampler = self.sampler if self.sampler is not None else self._default_sampler()
        if self.dataset_size is not None:
            sampler.public_size = self.dataset_size
        noise, clipping = self._noise_and_clipping()
        return PrivateStepEngine(
            sampler=sampler,
            clipping=clipping,
            noise=noise,
            step=self.step if self.step is not None else Step(),
            max_grad_norm=self.max_grad_norm,
            delta=self.delta,
            target_epsilon=self.target_epsilon,
            accountant=self.accountant,
            loss_reduction=self.loss_reduction,
            seed=self.seed,
            grad_sample_mode=self.grad_sample_mode,
            max_physical_batch_size=self.max_physical_batch_size,
        )

    def _noise_and_clipping(self) -> tuple[Noise, Clipping]:
        """The noise and clipping slots: the user's (defaults filled in), or secure noise's pair on one grid."""
        if not self.is_secure:
            noise = self.noise if self.noise is not None else ConstantNoise(self.noise_multiplier)
            return noise, self.clipping if self.clipping is not None else FlatClipping()
        secure = (
            self.noise
            if isinstance(self.noise, DiscreteGaussian)
            else DiscreteGaussian(self.noise_multiplier)
        )
        return secure, GridClipping(secure.grid)

    def _default_sampler(self) -> Sampler:
        """Poisson over examples, or over users for ``privacy_unit="user"`` (the keyword form of UserPoisson)."""
        if self.privacy_unit != "user":
            return Poisson(seed=self.seed)
        assert self.examples_per_user is not None
        assert self.users_per_step is not None
        return UserPoisson(
            user_key=self.user_key,
            examples_per_user=self.examples_per_user,
            users_per_step=self.users_per_step,
            selection=self.unit_selection,
            reduction=self.unit_reduction,
            max_examples_per_user=self.max_examples_per_user,
            seed=self.seed,
        )

    @property
    def user_level(self) -> bool:
        """Whether the run's privacy unit is the user (the keyword form or a ``UserPoisson`` slot)."""
        return self.privacy_unit == "user" or (self.sampler is not None and self.sampler.unit == "user")


_PUBLIC_KNOBS = (
    "Each is a public hyperparameter: choose it from public knowledge, not from the private per-user counts "
    "(k = the median examples per user is a statistic of the data, which ε does not cover; pay for a search "
    "with lightning-dp tune)."
)


def _validate_unit(config: PrivacyConfig) -> None:
    """The privacy-unit arguments (``docs/user-level.md``), and what user-level runs refuse in v1."""
    owner = config.owner
    if config.privacy_unit not in ("example", "user"):
        raise DPConfigurationError(
            f"{owner}: privacy_unit must be 'example' or 'user', got {config.privacy_unit!r}."
        )
    if config.unit_selection not in ("random", "cycle"):
        raise DPConfigurationError(
            f"{owner}: unit_selection must be 'random' or 'cycle', got {config.unit_selection!r}."
        )
    if config.unit_reduction not in ("mean", "sum"):
        raise DPConfigurationError(
            f"{owner}: unit_reduction must be 'mean' or 'sum', got {config.unit_reduction!r}."
        )
    for name in ("examples_per_user", "users_per_step", "max_examples_per_user"):
        number(getattr(config, name), name, owner=owner, low=1, integer=True, optional=True)
    keywords = {
        "examples_per_user": config.examples_per_user,
        "users_per_step": config.users_per_step,
        "unit_selection": None if config.unit_selection == "random" else config.unit_selection,
        "unit_reduction": None if config.unit_reduction == "mean" else config.unit_reduction,
    }
    given = [name for name, value in keywords.items() if value is not None]
    if config.privacy_unit == "user" and config.sampler is not None and config.sampler.unit != "user":
        raise DPConfigurationError(
            f"{owner}: privacy_unit='user' samples users, but sampler={config.sampler.name} samples "
            f"examples: {config.sampler.name} with users is not priced in this version. Leave sampler unset "
            "(the keywords build UserPoisson), or pass sampler=UserPoisson(...)."
        )
    if config.sampler is not None and config.sampler.unit == "user":
        if given or config.user_key is not None or config.max_examples_per_user is not None:
            raise DPConfigurationError(
                f"{owner}: give the user sampling either as keywords (user_key, examples_per_user, users_per_step, "
                "unit_selection, unit_reduction, max_examples_per_user) or as sampler=UserPoisson(...), not both."
            )
    elif config.privacy_unit == "user":
        missing = [
            name
            for name in ("user_key", "examples_per_user", "users_per_step")
            if getattr(config, name) is None
        ]
        if missing:
            raise DPConfigurationError(
                f"{owner}: privacy_unit='user' needs {', '.join(missing)}: user_key says whose each example is, "
                "examples_per_user (k) bounds the rows a sampled user contributes to a step and users_per_step "
                f"(B_u) is the expected users per step (q = B_u / U). {_PUBLIC_KNOBS}"
            )
    elif given:
        raise DPConfigurationError(
            f"{owner}: {', '.join(given)} only apply with privacy_unit='user'. Add privacy_unit='user' for "
            "user-level DP, or remove them (for a user-level statement about an example-level run, give "
            "user_key and max_examples_per_user)."
        )
    if config.max_examples_per_user is not None and config.user_key is None and not config.user_level:
        raise DPConfigurationError(
            f"{owner}: max_examples_per_user={config.max_examples_per_user} needs user_key=... (whose each "
            "example is) to keep at most that many examples per user."
        )
    if config.user_level:
        refuse_with_users(config, owner)


def _validate(config: PrivacyConfig) -> None:
    """Type and range of every argument, named in the message (lightning_dp/validation.py)."""
    owner = config.owner
    if config.check_sensitivity != "every_step":
        validation.flag(config.check_sensitivity, "check_sensitivity", owner=owner)
    number(config.check_overhead, "check_overhead", owner=owner, low=0, high=1, low_open=True)
    validation.flag(config.isolate_examples, "isolate_examples", owner=owner)
    if not all(isinstance(name, str) for name in config.public_buffers):
        raise DPConfigurationError(f"{owner}: public_buffers must be buffer names or patterns (strings).")
    units = config.user_level or config.augmentation_multiplicity != 1
    if config.isolate_examples and config.max_physical_batch_size not in (None, 1) and not units:
        # With units, isolate_examples runs each unit alone and max_physical_batch_size bounds its rows.
        raise DPConfigurationError(
            f"{owner}: isolate_examples=True runs each example through training_step alone; "
            f"max_physical_batch_size={config.max_physical_batch_size} would group them again. Leave it unset."
        )
    number(config.target_epsilon, "target_epsilon", owner=owner, low=0, low_open=True, optional=True)
    number(
        config.delta, "delta", owner=owner, low=0, high=1, low_open=True, high_open=True,
        hint=" Typical values are 1e-5 or below 1/N.",
    )  # fmt: skip
    number(
        config.max_grad_norm, "max_grad_norm", owner=owner, low=0, low_open=True, allow_inf=True,
        hint=" It is the clipping bound C.",
    )  # fmt: skip
    number(config.noise_multiplier, "noise_multiplier", owner=owner, low=0, optional=True)
    number(
        config.max_physical_batch_size, "max_physical_batch_size", owner=owner, low=1, integer=True,
        optional=True,
    )  # fmt: skip
    validation.seed(config.seed, owner=owner)
    if math.isinf(config.max_grad_norm) and (
        config.noise_multiplier is None or config.noise_multiplier > 0 or config.target_epsilon is not None
    ):
        raise DPConfigurationError(
            f"{owner}: max_grad_norm=inf with noise: the noise's standard deviation is σ·C, so an unbounded C "
            "turns every weight into NaN and bounds no example's contribution. Give a finite clipping bound "
            "(e.g. max_grad_norm=1.0); C=inf is accepted only with noise_multiplier=0 (no privacy)."
        )
    if config.accountant not in ("rdp", "prv", "pld", "pure"):
        raise DPConfigurationError(
            f"accountant must be 'rdp', 'prv', 'pld' or 'pure', got {config.accountant!r}."
        )
    if config.data_changes not in ("refuse", "public"):
        raise DPConfigurationError(
            f"{owner}: data_changes must be 'refuse' or 'public', got {config.data_changes!r}."
        )
    if config.loss_reduction not in ("mean", "sum"):
        raise DPConfigurationError(f"loss_reduction must be 'mean' or 'sum', got {config.loss_reduction!r}.")
    if config.noise is not None and config.noise_multiplier is not None:
        raise DPConfigurationError("Give either noise=... or noise_multiplier=..., not both.")
    _validate_clipping(config)
    _validate_augmentation(config)
    _validate_secure(config)
    number(config.dataset_size, "dataset_size", owner=owner, low=1, integer=True, optional=True)
    if (
        config.dataset_size is not None
        and config.sampler is not None
        and not config.sampler.takes_public_size
    ):
        raise DPConfigurationError(
            f"{owner}: dataset_size={config.dataset_size} with sampler={config.sampler.name}: its guarantee depends "
            "on the real number of examples (it samples a fixed share of them, or weighs them), so q cannot come "
            "from a declared size. Use the default Poisson sampler (or UserPoisson, CyclicPoisson) with "
            "dataset_size, or leave dataset_size unset."
        )


def _validate_secure(config: PrivacyConfig) -> None:
    """``secure=True`` swaps in the noise and clipping slots of secure noise: refuse slots it would replace."""
    owner = config.owner
    validation.flag(config.secure, "secure", owner=owner)
    if not config.is_secure:
        return
    if config.noise is not None and not isinstance(config.noise, DiscreteGaussian):
        raise DPConfigurationError(
            f"{owner}: secure=True with noise={config.noise.name}: secure noise is the discrete Gaussian. Leave "
            "noise unset (noise_multiplier=... or target_epsilon sets σ), or pass noise=DiscreteGaussian(...)."
        )
    if math.isinf(config.max_grad_norm):
        raise DPConfigurationError(
            f"{owner}: secure=True with max_grad_norm=inf: the integer grid's step is proportional to C (γ = "
            "2·rounding_slack·C/√d), so an unbounded C has no grid. Give a finite clipping bound."
        )
    if config.clipping is not None and type(config.clipping) is not FlatClipping:
        raise DPConfigurationError(
            f"{owner}: secure=True with clipping={config.clipping.name}: secure noise rounds DP-SGD's flat L2 "
            "clipping onto its integer grid and cannot round another clipping. Leave clipping unset."
        )


def _validate_clipping(config: PrivacyConfig) -> None:
    """A clipping that sets C itself ignores ``max_grad_norm``; one that scales by it needs it finite."""
    clipping, owner = config.clipping, config.owner
    if clipping is None or config.max_grad_norm == 1.0:
        return
    if type(clipping).clip_bound is not Clipping.clip_bound:
        raise DPConfigurationError(
            f"{owner}: max_grad_norm={config.max_grad_norm:g} with clipping={clipping.name}, which sets the "
            "clipping bound itself from released values (starting at its initial_norm) and would ignore it. "
            f"Leave max_grad_norm unset and give {clipping.name}(initial_norm=...) to choose where C starts."
        )
    if isinstance(clipping, AutoClipping) and math.isinf(config.max_grad_norm):
        raise DPConfigurationError(
            f"{owner}: max_grad_norm=inf with AutoClipping: each example's gradient is scaled to norm just "
            "below max_grad_norm, so an infinite one makes every gradient infinite. Leave max_grad_norm at its "
            "default 1 (the learning rate sets the step) or give a finite one."
        )


def _validate_augmentation(config: PrivacyConfig) -> None:
    """K views of each example are one unit: they must fit one physical chunk and be clipped together."""
    owner, views = config.owner, config.augmentation_multiplicity
    number(views, "augmentation_multiplicity", owner=owner, low=1, integer=True)
    if views == 1:
        return
    chunk = config.max_physical_batch_size
    if chunk is not None and views > chunk:
        raise DPConfigurationError(
            f"{owner}: augmentation_multiplicity={views} with max_physical_batch_size={chunk}: an example's "
            f"{views} views are clipped as one unit, so they must go through one physical chunk (clipped in two "
            f"chunks, the example would count 2C). Set max_physical_batch_size to at least {views}, or unset it "
            "(isolate_examples=True runs each example with all its views alone)."
        )
    if isinstance(config.step, AdaptiveGD | LineSearch):
        raise DPConfigurationError(
            f"{owner}: augmentation_multiplicity={views} with {config.step.name}: its step-size search sums "
            "clipped per-row losses, and an example's views are several rows, so one example would move that "
            f"sum by {views} times its bound. Use the default step or HeavyBall/Nesterov with augmentation "
            f"multiplicity, or augmentation_multiplicity=1 with {config.step.name}."
        )
    if isinstance(config.sampler, DPIS):
        raise DPConfigurationError(
            f"{owner}: augmentation_multiplicity={views} with DPIS: DPIS weighs and bounds each sampled example "
            "by its own per-example norm, not by the mean of its views. Use the default Poisson sampler with "
            "augmentation multiplicity, or augmentation_multiplicity=1 with DPIS."
        )
