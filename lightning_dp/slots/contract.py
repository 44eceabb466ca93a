"""The four slots of a private step (see CONTRIBUTING.md): sampler, clipping, noise, step.

Every mechanism is one small object in one slot. The strategy only wires them together and asks
the ledger to price what they release; a slot never touches Lightning itself. Over 500 lines by design:
every hook and capability a slot may implement is declared here with its default and docstring, so the
whole contract reads in one file (CONTRIBUTING.md).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
from torch import Tensor, nn

from lightning_dp.accounting import PrivacyEvent, PrivacyLedger
from lightning_dp.accounting.discrete_gaussian import IntegerGrid
from lightning_dp.slots.context import StepContext
from lightning_dp.slots.release import Releases

if TYPE_CHECKING:
    from lightning_dp.per_example import PerExampleGradients


class Slot:
    """What the four slots share: a name, a mechanism kind, a seed, and state that checkpoints resume exactly."""

    mechanism: str = "gaussian"
    """The kind of release this slot is built for: "gaussian" (default) or "laplace" (pure ε-DP);
    :func:`~lightning_dp.slots.compatibility.check_mechanisms` refuses slots of different kinds together."""
    seed: int | None = None
    """The slot's own seed, if it draws random numbers (None: ``os.urandom``; a resumed run then does
    not restore the slot's generator states)."""
    tracks_parameters: bool = False
    """Whether the slot keeps state per trainable parameter, by position (AdaCliP's running mean, a
    momentum): such a run refuses a change of the trainable parameters once it has taken a step
    (``BackboneFinetuning`` unfreezing a backbone); stateless slots cover the new set from that step on."""
    refuses_user_level: str | None = None
    """Why user-level DP is not priced with this slot in this version (the refusal's reason, after "cannot
    be used with user-level DP in this version: "); None: it is. Read by ``strategies/refusals.py``."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state

    def resume_at(self, steps: int) -> None:
        """Called after a checkpoint written inside a step (an interrupt) was loaded: ``steps`` private
        steps were released, and the one that was interrupted runs again. A slot whose counters advance
        before the release (steps begun) sets them back to ``steps``. Default: nothing to set."""
        del steps

    @property
    def name(self) -> str:
        return type(self).__name__


@dataclass
class SamplerRuntime:
    """What the strategy lends a sampler whose probabilities depend on the model (DPIS).

    Handed over once the data and the training length are known (``Sampler.attach_runtime``).
    """

    norms: Callable[[Tensor], Tensor]
    """Per-example gradient L2 norms (fp64, CPU) of the given dataset indices at the current weights.
    Nothing is released and the weights do not move: the caller must price whatever it derives."""
    ledger: PrivacyLedger
    """The run's ledger, to read (price a plan); releases are recorded through ``Sampler.use_releases``."""
    target_epsilon: float | None
    delta: float
    planned_steps: int
    steps_per_epoch: int
    max_grad_norm: float
    fixed_noise_multiplier: float | None
    """σ given by the user (noise slot already set), else None: the sampler schedules σ itself."""
    clipping: Clipping
    all_reduce: Callable[[list[Tensor]], list[Tensor]] | None = None
    """Sum CPU tensors over all ranks (None on one process). The built-in samplers release through
    ``Releases.noisy_statistic`` instead; kept for samplers that need a plain collective."""


class Sampler(Slot, ABC):
    """Which examples form each batch, and with what probability (drives the sample rate q)."""

    sample_rate: float = 0.0
    schedules_noise: bool = False
    """True for samplers that set σ themselves (``step_noise_multiplier``); the strategy then skips
    the noise slot's calibration."""
    carries_batch_info: bool = False
    """True when the batch sampler yields :class:`~lightning_dp.core.batches.IndicesWithInfo`: the info
    travels with the batch through DataLoader prefetching and is handed back via ``begin_step``."""
    restored_shape: tuple[int | None, float | None] = (None, None)
    """(N, q) read from a checkpoint by ``load_state_dict``: a resume on other data or another batch
    size is refused (None: the sampler keeps no such record)."""
    bands: int | str | None = None
    """Cyclic participation: each example joins only the steps t ≡ g(i) (mod ``bands``) of its own group
    g(i) (``CyclicPoisson``; ``Poisson`` is ``bands=1``: one group, every step). ``"auto"`` until the noise
    slot chooses it (:meth:`choose_bands`); None: no such structure (DPIS, FixedSize), which correlated
    noise refuses."""
    horizon: int | None = None
    """The run's planned steps, for samplers handed a runtime (the noise slot fits its strategy to it)."""
    unit: str = "example"
    """The privacy unit one draw samples: ``"example"``, or ``"user"`` (``UserPoisson``: then ``num_samples``
    is U, the number of users, and the ledger's q is over users)."""

    weighs_examples: bool = False
    """True for samplers whose ``weigh`` weighs and bounds each sampled example by its own per-example norm
    (DPIS): a unit of several rows (an example's augmented views) is then refused."""

    public_size: int | None = None
    """N (U for a user sampler) declared public with ``DPStrategy(dataset_size=...)``: q, the divisor q·N and
    the steps of an epoch come from it, never from the data set's real size (set before ``bind``; None: the
    real size is used and assumed public). Only samplers with ``takes_public_size`` accept one."""
    takes_public_size: bool = False
    """Whether this sampler's guarantee holds for a q set from a declared size whatever the real one is
    (Poisson sampling: each unit joins with probability q, independently of how many there are)."""

    @property
    def size_for_releases(self) -> int:
        """The N every released constant is computed from: the declared public size, else the real one."""
        return self.public_size if self.public_size is not None else self.num_samples

    def bind_dataset(self, dataset: Any) -> None:
        """Called by the strategy with the train ``Dataset`` before ``bind``, for samplers that read
        per-example metadata (``UserPoisson``: each example's user id). Default: nothing to read."""
        del dataset

    def batches_per_epoch(self, num_samples: int, batch_size: int) -> int:
        """The steps of one epoch (after ``bind``): each unit sampled once in expectation, ⌈N / B⌉ (N the
        declared public size, if any)."""
        size = self.public_size if self.public_size is not None else num_samples
        return max(1, math.ceil(size / batch_size))

    def attach_runtime(self, runtime: SamplerRuntime) -> None:
        """Called by the strategy before every epoch's loader is built; default: nothing to keep."""
        del runtime

    def use_releases(self, releases: Releases) -> None:
        """Called once by the engine: samplers that release statistics of the data (DPIS) price and
        record them through ``releases.spend``. Default: nothing to keep."""
        del releases

    def begin_step(self, info: Any) -> None:
        """The info snapshot that the batch of the step about to run carried (``carries_batch_info``)."""
        del info

    def step_noise_multiplier(self) -> float | None:
        """σ of the next step for samplers with ``schedules_noise`` (None: not known yet)."""
        return None

    def pending_events(self) -> list[PrivacyEvent]:
        """Releases this sampler must make before the next step can run (DPIS's statistics at an epoch
        start); the budget stop prices them together with the step, so it stops before them. Default: none."""
        return []

    def weigh(self, grad_samples: PerExampleGradients, ctx: StepContext) -> tuple[Tensor, float] | None:
        """Per-example weights w and the L2 sensitivity of Σ w_i g_i, for samplers whose inclusion
        probabilities depend on the gradients (DPIS). None (default): the clipping slot bounds them."""
        del grad_samples, ctx
        return None

    def choose_bands(self, bands: int) -> None:
        """Resolve ``bands="auto"`` (called by a correlated noise slot while it calibrates, after ``bind``)."""
        raise NotImplementedError(f"{self.name} has no cyclic bands to choose")

    @abstractmethod
    def bind(self, num_samples: int, batch_size: int, rank: int = 0, world_size: int = 1) -> None:
        """Fix the dataset size and the public expected batch size; sets ``sample_rate``."""

    @abstractmethod
    def batch_sampler(self, num_batches: int) -> torch.utils.data.Sampler[list[int]]:
        """The index batches for one epoch of ``num_batches`` steps; every step yields, even empty."""

    @abstractmethod
    def event(self, noise_multiplier: float) -> PrivacyEvent:
        """The ledger event one step releases with this noise multiplier."""

    @property
    def expected_batch_size(self) -> float:
        return self.sample_rate * self.size_for_releases

    num_samples: int = 0


ClipAndSum = Callable[..., list[Tensor]]


def sums_once(clip_and_sum: ClipAndSum) -> ClipAndSum:
    """Mark a ``clip_and_sum`` that reads the per-example gradients no more after its one weighted sum.

    The engine then frees each layer's inputs, output gradients and cached per-example gradients as
    that sum takes them, which lowers the step's peak memory. An override is unmarked unless it is
    decorated too, so a subclass that inspects the gradients after the sum keeps working.
    """
    clip_and_sum.sums_once = True  # type: ignore[attr-defined]
    return clip_and_sum


class Clipping(Slot, ABC):
    """How each per-example gradient is bounded before the noisy sum is released."""

    @property
    def sums_once(self) -> bool:
        """Whether this class's ``clip_and_sum`` is marked with :func:`sums_once`."""
        return bool(getattr(type(self).clip_and_sum, "sums_once", False))

    def setup(self, params: Sequence[Tensor]) -> None:
        """Called once the trainable parameters are known (allocate per-coordinate state here)."""
        del params

    needs_finite_clip: bool = False
    """True for clippings that scale every gradient to the bound C itself (AutoClipping): an infinite
    ``max_grad_norm`` would make every gradient infinite, so it is refused."""

    @property
    def adapts_clip_bound(self) -> bool:
        """Whether this clipping sets C itself from released values (it implements ``clip_bound``): a
        ``max_grad_norm`` it would ignore is refused."""
        return type(self).clip_bound is not Clipping.clip_bound

    @property
    def is_flat_l2(self) -> bool:
        """Whether the clipped sum is DP-SGD's flat L2 one (mechanisms that assume it, DPIS and DP-AGD, check)."""
        return False

    @property
    def integer_grid(self) -> IntegerGrid | None:
        """The integer grid ``clip_and_sum``'s int64 sums are on (``GridClipping``, secure noise); None:
        float sums. :func:`~lightning_dp.slots.compatibility.check_mechanisms` pairs it with the noise slot's."""
        return None

    @abstractmethod
    def clip_and_sum(self, grad_samples: PerExampleGradients, ctx: StepContext) -> list[Tensor]:
        """Sum over examples of the bounded per-example gradients, in fp32, one tensor per parameter.

        Return fresh tensors: the engine adds the noise to them in place.

        ``grad_samples[j]`` has shape ``[B, *param_j.shape]`` (B may be 0); ``sq_norms()``,
        ``weighted_sum()`` and ``layers()`` read them without materialising.
        """

    def sensitivity(self, ctx: StepContext) -> float:
        """L2 sensitivity of the released sum; the noise std is noise_multiplier × this."""
        return ctx.max_grad_norm

    joint_statistic: bool = False
    """True for clippings that release a statistic of the batch besides the gradient, priced with it in the
    step's one Gaussian event (quantile clipping's count, Andrew et al. 2021 Thm 1): the step's σ is then the
    combined one, the gradient is noised at :meth:`gradient_noise_multiplier`, and
    ``compatibility.check_mechanisms`` refuses slots whose own rules would leave the statistic unpriced."""

    def use_releases(self, releases: Releases) -> None:
        """Called once by the engine: clippings with a ``joint_statistic`` release it through ``releases``
        (in ``finalize``, once per gradient release). Default: nothing to keep."""
        del releases

    def clip_bound(self, configured: float) -> float:
        """The bound C of the next release (default: the configured ``max_grad_norm``); clippings that adapt
        it from released values (quantile clipping) return their own."""
        return configured

    def gradient_noise_multiplier(self, noise_multiplier: float, expected_batch_size: float) -> float:
        """σ of the clipped sum (relative to ``sensitivity``) in a step whose ledger event has σ =
        ``noise_multiplier``; default: that σ. A ``joint_statistic`` clipping returns the gradient's share
        of the combined σ, and refuses a σ it cannot split (a ``DPConfigurationError``)."""
        del expected_batch_size
        return noise_multiplier

    def metrics(self) -> dict[str, float]:
        """Released (or post-processed) values worth logging each step (``dp/clip_norm``); default: none."""
        return {}

    def report(self) -> dict[str, Any] | None:
        """Plain JSON-able facts for the privacy report (``"clip_norm"``); None: nothing to add."""
        return None

    def finalize(self, noisy_sums: list[Tensor], ctx: StepContext) -> list[Tensor]:
        """Turn the released noisy sums into the gradient the step uses (post-processing only).

        May work in place: the engine hands over buffers nothing else holds (it copies them first
        for steps that keep the noisy sums).
        """
        return [s.div_(ctx.expected_batch_size) for s in noisy_sums]


NOISE_SLICE = 1 << 16
"""Largest number of Gaussians drawn at once by :meth:`Noise.add_noise` (256 KiB of fp32)."""


class Noise(Slot, ABC):
    """How much noise each step adds: a noise multiplier per step, and the draw itself."""

    @abstractmethod
    def noise_multiplier(self, step: int) -> float:
        """σ of step ``step`` (std of the noise = σ × clipping sensitivity)."""

    @abstractmethod
    def calibrate(
        self, target_epsilon: float, delta: float, sampler: Sampler, steps: int, accountant: str
    ) -> None:
        """Choose the schedule so that ``steps`` steps spend at most ``target_epsilon``."""

    @property
    def is_set(self) -> bool:
        """False until σ is known (given or calibrated)."""
        return True

    is_constant: bool = False
    """True for a slot whose σ is one number for every step (given or calibrated): a step that brings
    its own noise rule may start from it."""

    def link_step(self, step: Step) -> None:
        """Called once with the run's step slot (schedules that weight steps by its error bound)."""
        del step

    @property
    def integer_grid(self) -> IntegerGrid | None:
        """The integer grid of the sums this slot adds noise to (``DiscreteGaussian``, secure noise); None:
        float sums. The clipping slot must be on the very same grid."""
        return None

    correlated: bool = False
    """True for noise correlated across steps (matrix factorization: BandMF, BLT). Every ``add_noise``
    advances its state, so the gradient must be a step's only noisy release, and the step, sampler and
    clipping slots must not assume i.i.d. noise (``compatibility.check_mechanisms`` refuses them)."""

    def link_sampler(self, sampler: Sampler) -> None:
        """Called once, when the engine is built, with the run's sampler (correlated noise reads its bands)."""
        del sampler

    def setup(self, params: Sequence[Tensor]) -> None:
        """Called once the trainable parameters are known (noise that keeps per-parameter state)."""
        del params

    def link_ranks(self, world_size: int) -> None:
        """Called when the processes exist, with their number W: noise whose shares' sum is priced by W
        (``DiscreteGaussian``: a sum of W discrete Gaussians is not one). Default: nothing to keep."""
        del world_size

    @property
    def steps_per_event(self) -> int:
        """How many consecutive steps one ledger event pays for: the engine checks the budget and records
        the event only at steps that are multiples of it (b for BandMF under cyclic sampling; default 1)."""
        return 1

    def step_event(self, step: int, sampler: Sampler, noise_multiplier: float) -> PrivacyEvent | None:
        """The ledger event of step ``step`` when this noise decides it (BLT: an unamplified Gaussian of the
        step's sensitivity increment); None (default): the step slot's ``gradient_event``."""
        del step, sampler, noise_multiplier
        return None

    def describe(self) -> str | None:
        """One line for the start of training (what was fitted and chosen); None: nothing to say."""
        return None

    def report(self) -> dict[str, Any] | None:
        """Plain JSON-able facts for the privacy report (``"correlated_noise"``); None: nothing to add."""
        return None

    def add_noise(self, sums: list[Tensor], std: float, generator: torch.Generator) -> list[Tensor]:
        """Gaussian noise of standard deviation ``std`` on every coordinate, drawn in fp32.

        Adds in place: the sums are the engine's own fresh buffers (``clip_and_sum`` must not return
        tensors it keeps), and one fused pass is measurably cheaper on large models.
        """
        if std == 0.0:
            return sums
        for s in sums:
            # Drawn a slice at a time: no parameter-sized noise buffer, and the slice is still in cache
            # when it is added (as fast as one draw on CPU; the stream differs from one draw's).
            for part in s.view(-1).split(NOISE_SLICE) if s.is_contiguous() else [s]:
                part.add_(
                    torch.randn(part.shape, generator=generator, device=s.device, dtype=s.dtype), alpha=std
                )
        return sums


@dataclass(frozen=True)
class StepSetup:
    """The run's privacy settings and the user's slots, as a step slot sees them when it declares its plan."""

    noise: Noise
    clipping: Clipping
    accountant: str
    target_epsilon: float | None
    delta: float
    max_grad_norm: float


@dataclass(frozen=True)
class StepPlan:
    """What a step brings besides moving the weights, declared once before the engine is built.

    ``noise``: the noise slot that replaces the user's (the step sets σ itself, e.g. from a zCDP budget);
    ``ledger``: the ledger rule of the whole run (a privacy filter, for steps whose releases depend on
    earlier noisy results). None: the user's noise slot / an ordinary ledger.
    """

    noise: Noise | None = None
    ledger: PrivacyLedger | None = None


class StepHost(Protocol):
    """What a step slot may use of the run that drives it (the engine), beyond its ``StepContext``.

    A second release, a query's price or a collective goes through ``releases``; the rest is read-only.
    """

    @property
    def releases(self) -> Releases: ...

    @property
    def attached(self) -> bool:
        """Whether the per-example gradient hooks are on the model (``params`` is known)."""
        ...

    @property
    def params(self) -> list[nn.Parameter]: ...

    @property
    def module(self) -> nn.Module | None: ...

    @property
    def batch(self) -> Any: ...

    @property
    def train_data(self) -> tuple[Any, Any] | None: ...

    @property
    def sampler(self) -> Sampler: ...

    @property
    def loss_reduction(self) -> str: ...

    @property
    def max_physical_batch_size(self) -> int | None: ...

    def private_gradient(self, event: PrivacyEvent) -> list[Tensor]: ...

    def clear_gradients(self) -> None: ...


class Step(Slot):
    """How the private gradient (already in ``p.grad``) moves the weights; default: the user's optimizer."""

    needs_sums: bool = False
    """True: the engine also passes the clipped (pre-noise, this rank's) and the released noisy sums in
    ``ctx.clipped_sums`` / ``ctx.noisy_sums`` (steps that re-measure or rescale them)."""

    spends_until_budget: bool = False
    """True for steps whose run length is set by their budget, not by a plan (DP-AGD, the adaptive line
    search): the Trainer's step limit should not stop them first (a warning says so when it does)."""
    charges_unsampled: bool = False
    """True for steps whose privacy filter charges a subsampled measurement as unsampled (zCDP): a
    minibatch then buys no amplification (a warning says so at fit start)."""
    queries_losses: bool = False
    """True for steps that release statistics of clipped per-row losses besides the gradient (a step-size
    search: LineSearch, AdaptiveGD): a unit of several rows (augmented views) would move them by several bounds."""

    @property
    def brings_own_rules(self) -> bool:
        """Whether the step brings its own noise or ledger rule (it implements ``plan`` or ``gradient_event``)."""
        return type(self).plan is not Step.plan or type(self).gradient_event is not Step.gradient_event

    @property
    def adapts_clip_bound(self) -> bool:
        """Whether the step sets the clipping bound itself (it implements ``clip_bound``: DP-BLSGD-AC)."""
        return type(self).clip_bound is not Step.clip_bound

    @property
    def releases_one_gradient(self) -> bool:
        """Whether each step's one noisy release is the gradient, priced as the sampler's event at the noise
        slot's σ, and the step reads no sums and no budget of its own: what correlated and secure noise need."""
        return not (
            self.brings_own_rules or self.needs_sums or self.spends_until_budget or self.charges_unsampled
        )

    def plan(self, setup: StepSetup) -> StepPlan:
        """Called once, before the engine is built: the noise slot and ledger rule this step brings
        (default: none; the user's). Refuse settings the algorithm cannot price here."""
        del setup
        return StepPlan()

    def bind(self, host: StepHost) -> None:
        """Called once the engine is built, for steps that query the data again or release more than
        the gradient (through ``host.releases``). Default: nothing to keep."""
        del host

    def clip_bound(self, configured: float) -> float:
        """The clipping bound C of the next release (default: the configured ``max_grad_norm``); steps
        that adapt it from released values (DP-BLSGD-AC) return their own."""
        return configured

    def gradient_event(self, sampler: Sampler, noise_multiplier: float) -> PrivacyEvent:
        """The ledger event of one noisy gradient (default: the sampler's subsampled Gaussian)."""
        return sampler.event(noise_multiplier)

    def step(self, optimizer: torch.optim.Optimizer, ctx: StepContext) -> None:
        del ctx
        optimizer.step()

    def finalize(self, optimizer: torch.optim.Optimizer) -> None:
        """At the end of training; steps that train on a look-ahead point (Nesterov) write their final
        iterate into the weights here. Default: nothing."""
        del optimizer

    def noise_log_weights(self, horizon: int) -> Any:
        """log a_{T,k}, k = 1..T, of this step's error bound (NoiseDividing's weights); None: the step
        has no such bound."""
        del horizon
        return None

    def metrics(self) -> dict[str, float]:
        """Released (or post-processed) values worth logging each step; default: none."""
        return {}


def iter_slots(*slots: Slot) -> Iterator[tuple[str, Slot]]:
    """(slot name, object) pairs in the fixed order the checkpoint uses."""
    yield from zip(("sampler", "clipping", "noise", "step"), slots, strict=True)


_Init = TypeVar("_Init", bound=Callable[..., None])


def takes_config(config_type: type[Any]) -> Callable[[_Init], _Init]:
    """Give a slot's ``__init__(self, **options)`` the keyword-only signature of a config dataclass's fields
    (typed, with their plain defaults) that callers, ``help()`` and jsonargparse (LightningCLI YAML) read, and
    the config's docstring: the settings are listed and documented once, in the config (``init.config_type``)."""

    def decorate(init: _Init) -> _Init:
        hints = typing.get_type_hints(config_type)
        first = next(iter(inspect.signature(init).parameters.values()))
        keyword = inspect.Parameter.KEYWORD_ONLY
        fields = [
            inspect.Parameter(f.name, keyword, default=f.default, annotation=hints[f.name])
            for f in dataclasses.fields(config_type)
        ]
        init.__signature__ = inspect.Signature([first, *fields], return_annotation=None)  # type: ignore[attr-defined]
        init.config_type = config_type  # type: ignore[attr-defined]
        init.__doc__ = config_type.__doc__
        return init

    return decorate
