"""PrivacyConfig: the one typed definition of the privacy options every strategy takes, validated once.

Each field is an option of :class:`~lightning_dp.DPStrategy`, :class:`~lightning_dp.DPDDPStrategy` and
:class:`~lightning_dp.DPFSDPStrategy`: :func:`takes_privacy_options` gives each strategy's ``__init__`` the
signature that callers, ``help()`` and jsonargparse (LightningCLI YAML) read, built from these fields, so a
new option is added here and nowhere else. The config then validates the options and builds the engine.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import typing
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar

from lightning_dp.clipping import FlatClipping
from lightning_dp.clipping.integer_grid import GridClipping
from lightning_dp.core import validation
from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.core.validation import number
from lightning_dp.engine import PrivateStepEngine
from lightning_dp.noise import ConstantNoise
from lightning_dp.noise.discrete_gaussian import DiscreteGaussian
from lightning_dp.per_example import GradMode
from lightning_dp.run.prepare import OnBatchNorm
from lightning_dp.sampling import Poisson
from lightning_dp.slots import Clipping, Noise, Sampler, Step
from lightning_dp.strategies import deprecated
from lightning_dp.strategies.options import Checks, UserBound
from lightning_dp.strategies.refusals import refuse_with_users

DEFAULT_TARGET_EPSILON = 3.0
Accountant = Literal["rdp", "prv", "pld", "pure"]


@dataclass(frozen=True)
class PrivacyConfig:
    """What a private run promises and how it is built: the budget, C, the accountant, the four slots and
    the option objects. Every strategy takes these options by keyword, with these defaults.

    A slot left as None is the default (Poisson sampling, flat L2 clipping, constant σ, the user's
    optimizer); ``target_epsilon`` defaults to 3 when neither it nor a noise level is given.

    Args:
        target_epsilon: privacy budget ε. σ is calibrated so the planned steps spend at most this, and
            training stops before a step that would exceed it. Defaults to 3 when neither it nor
            ``noise_multiplier`` is given.
        delta: δ of the (ε, δ) guarantee; keep it well below 1/N.
        max_grad_norm: per-example clipping bound C, an L2 norm over all trainable parameters, in the
            gradient's own units.
        noise_multiplier: σ given directly (then ``target_epsilon``, if also given, is only a budget stop).
        accountant: ``"rdp"``, ``"prv"`` or ``"pld"`` (needs ``pip install dp-accounting``); ``"pure"`` sums
            pure ε (basic composition) for Laplace steps, on one process.
        sampler: which examples form each batch (default :class:`~lightning_dp.Poisson`: each example
            joins with probability q = batch_size / N); :class:`~lightning_dp.UserPoisson` samples users
            (user-level DP, ``docs/user-level.md``).
        clipping: how each per-example gradient is bounded (default :class:`~lightning_dp.FlatClipping`:
            L2 norm ≤ C).
        noise: σ of each step (default :class:`~lightning_dp.ConstantNoise`: one σ, given or calibrated).
        step: how the private gradient moves the weights (default: the user's own optimizer).
        on_batchnorm: ``"raise"`` or ``"replace"`` (BatchNorm → GroupNorm in place).
        loss_reduction: whether ``training_step`` returns the batch ``"mean"`` (default) or ``"sum"``.
        seed: makes sampling and noise reproducible; by default both are seeded from ``os.urandom``. A slot
            given by the user draws from its own ``seed``.
        max_physical_batch_size: split each logical batch into chunks of at most this many examples
            (virtual batching): memory no longer limits the logical batch, q or ε. Noise is added once.
        grad_sample_mode: ``"auto"`` (fast clipping without per-example gradients when every layer
            supports it), ``"fast"`` (fast where supported, materialised elsewhere) or ``"materialize"``.
        checks: the run-time checks' settings (:class:`~lightning_dp.Checks`: the mixing check and its time
            budget, isolation, public buffers, data changes between epochs).
        augmentation_multiplicity: K (default 1): the train ``Dataset`` is called K times per sampled
            index (its random transforms draw K views), ``training_step`` sees the K views as consecutive
            rows, and their gradients are averaged before the clip (De et al. 2022); ε does not change.
        user_bound: at most k examples per user, enforced, on an example-level run
            (:class:`~lightning_dp.UserBound`): the report adds a user-level ε by group privacy.
        secure: secure noise (``docs/guarantees.md``): each clipped per-example gradient is rounded onto an
            integer grid, the sum is exact in int64, and the noise is a discrete Gaussian drawn from
            ``os.urandom`` (:class:`~lightning_dp.DiscreteGaussian`), so no floating-point sample can be
            attacked. Priced with a bound valid for the discrete Gaussian; the noise is 0.1 % larger and the
            per-example gradients are materialised.
        dataset_size: N declared public (U, the number of users, under user sampling): q = batch_size / N,
            the divisor q·N and the steps per epoch come from it, so nothing released reads the real size of
            the training set; the report lists it as declared. Default: the real size, assumed public.
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
    checks: Checks = dataclasses.field(default_factory=Checks)
    augmentation_multiplicity: int = 1
    user_bound: UserBound | None = None
    secure: bool = False
    dataset_size: int | None = None
    owner: str = dataclasses.field(default="DPStrategy", compare=False)
    """The class named in error messages."""
    sigma_calibrated: ClassVar[bool] = False
    """Set per config: True when no σ was given, so it is calibrated from ``target_epsilon`` (from N and q)."""

    @classmethod
    def parameters(cls) -> tuple[str, ...]:
        """The privacy options a strategy's ``__init__`` takes (every field but ``owner``)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "owner")

    @classmethod
    def signature_parameters(cls) -> list[inspect.Parameter]:
        """The options as keyword-only parameters, with their resolved types and defaults."""
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}

        def default(name: str) -> Any:
            factory = fields[name].default_factory
            return fields[name].default if factory is dataclasses.MISSING else factory()

        keyword = inspect.Parameter.KEYWORD_ONLY
        return [
            inspect.Parameter(n, keyword, default=default(n), annotation=hints[n]) for n in cls.parameters()
        ]

    @classmethod
    def from_options(cls, options: Mapping[str, Any], owner: str) -> PrivacyConfig:
        """The config from a strategy's keyword options (its ``**options``), the deprecated keywords
        translated first; a keyword that is no option is refused as Python refuses one."""
        unknown = [
            name for name in options if name not in cls.parameters() and name not in deprecated.KEYWORDS
        ]
        if unknown:
            raise TypeError(f"{owner}.__init__() got an unexpected keyword argument {unknown[0]!r}")
        return cls(**deprecated.translate(options, owner), owner=owner)

    def __post_init__(self) -> None:
        _validate_option_types(self)
        _validate(self)
        _validate_users(self)
        no_noise_given = self.noise_multiplier is None and (self.noise is None or not self.noise.is_set)
        object.__setattr__(self, "sigma_calibrated", no_noise_given)
        if self.target_epsilon is None and no_noise_given:
            object.__setattr__(self, "target_epsilon", DEFAULT_TARGET_EPSILON)
        if self.noise_multiplier == 0:
            warnings.warn("noise_multiplier=0 adds no noise: this run has no privacy (ε = ∞).", stacklevel=5)

    @property
    def is_secure(self) -> bool:
        """Whether the run uses secure noise (``secure=True``, or a noise slot on an integer grid, such as
        ``DiscreteGaussian``)."""
        return self.secure or (self.noise is not None and self.noise.integer_grid is not None)

    @property
    def user_level(self) -> bool:
        """Whether the run's privacy unit is the user (a sampler of users, ``UserPoisson``)."""
        return self.sampler is not None and self.sampler.unit == "user"

    def build_engine(self) -> PrivateStepEngine:
        """The engine with this config's slots (defaults filled in), budget and clipping bound."""
        sampler = self.sampler if self.sampler is not None else Poisson(seed=self.seed)
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
        given = self.noise if self.noise is not None and self.noise.integer_grid is not None else None
        secure = given if given is not None else DiscreteGaussian(self.noise_multiplier)
        grid = secure.integer_grid
        assert grid is not None
        return secure, GridClipping(grid)


Init = TypeVar("Init", bound=Callable[..., None])


def takes_privacy_options(init: Init) -> Init:
    """Give a strategy's ``__init__(self, *, <its own arguments>, **options)`` the signature callers,
    ``help()`` and jsonargparse read: every PrivacyConfig option (typed, with its default), the deprecated
    keywords, then the strategy's own arguments; its docstring documents the options for ``--help``."""
    hints = typing.get_type_hints(init)
    first, *rest = inspect.signature(init).parameters.values()
    own = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in rest if p.kind is not p.VAR_KEYWORD]
    options = [*PrivacyConfig.signature_parameters(), *deprecated.parameters()]
    init.__signature__ = inspect.Signature([first, *options, *own], return_annotation=None)  # type: ignore[attr-defined]
    doc = inspect.cleandoc(PrivacyConfig.__doc__ or "")
    init.__doc__ = "\n".join([doc, *(f"    {name}: {text}" for name, text in deprecated.help_lines())])
    return init


def _validate_option_types(config: PrivacyConfig) -> None:
    """``checks`` and ``user_bound`` are their option objects (each validated itself)."""
    for name, kind, optional in (("checks", Checks, False), ("user_bound", UserBound, True)):
        value = getattr(config, name)
        if not isinstance(value, kind) and not (optional and value is None):
            raise DPConfigurationError(
                f"{config.owner}: {name} must be a lightning_dp.{kind.__name__}(...), got {type(value).__name__}."
            )


def _validate_users(config: PrivacyConfig) -> None:
    """A bound belongs to an example-level run; what user-level runs refuse in v1 (``docs/user-level.md``)."""
    if config.sampler is None or not config.user_level:
        return
    if config.user_bound is not None:
        raise DPConfigurationError(
            f"{config.owner}: user_bound=UserBound(...) bounds the examples of an example-level run, but "
            f"sampler={config.sampler.name} samples users: pass max_examples_per_user=... to "
            f"{config.sampler.name} instead."
        )
    refuse_with_users(config, config.owner)


def _validate(config: PrivacyConfig) -> None:
    """Type and range of every argument, named in the message (lightning_dp/core/validation.py)."""
    owner = config.owner
    units = config.user_level or config.augmentation_multiplicity != 1
    if config.checks.isolate_examples and config.max_physical_batch_size not in (None, 1) and not units:
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
    if config.noise is not None and config.noise.integer_grid is None:
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
    if clipping.adapts_clip_bound:
        raise DPConfigurationError(
            f"{owner}: max_grad_norm={config.max_grad_norm:g} with clipping={clipping.name}, which sets the "
            "clipping bound itself from released values (starting at its initial_norm) and would ignore it. "
            f"Leave max_grad_norm unset and give {clipping.name}(initial_norm=...) to choose where C starts."
        )
    if clipping.needs_finite_clip and math.isinf(config.max_grad_norm):
        raise DPConfigurationError(
            f"{owner}: max_grad_norm=inf with {clipping.name}: each example's gradient is scaled to norm just "
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
    if config.step is not None and config.step.queries_losses:
        raise DPConfigurationError(
            f"{owner}: augmentation_multiplicity={views} with {config.step.name}: its step-size search sums "
            "clipped per-row losses, and an example's views are several rows, so one example would move that "
            f"sum by {views} times its bound. Use the default step or HeavyBall/Nesterov with augmentation "
            f"multiplicity, or augmentation_multiplicity=1 with {config.step.name}."
        )
    if config.sampler is not None and config.sampler.weighs_examples:
        name = config.sampler.name
        raise DPConfigurationError(
            f"{owner}: augmentation_multiplicity={views} with {name}: {name} weighs and bounds each sampled example "
            "by its own per-example norm, not by the mean of its views. Use the default Poisson sampler with "
            f"augmentation multiplicity, or augmentation_multiplicity=1 with {name}."
        )
