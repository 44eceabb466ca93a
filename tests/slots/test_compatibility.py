"""Compatibility decided by what the slots declare (``lightning_dp/slots/compatibility.py``; the capabilities
are declared in ``slots/contract.py``).

Each capability is read by one decision: a custom slot that declares it gets the refusal (naming the slot)
without any table edit, and the same slot without the declaration is accepted.
"""

from __future__ import annotations

import math

import pytest

from lightning_dp import (
    BandMF,
    ConstantNoise,
    CyclicPoisson,
    DPConfigurationError,
    DPStrategy,
    FlatClipping,
    HeavyBall,
    LineSearch,
    Poisson,
    PrivacyConfig,
    QuantileClipping,
    Step,
    UserPoisson,
)
from lightning_dp.accounting.discrete_gaussian import IntegerGrid
from lightning_dp.clipping.integer_grid import GridClipping
from lightning_dp.slots import StepPlan, StepSetup

USERS = {"sampler": UserPoisson("user_id", 4, 8)}


# -- custom slots, each declaring one capability --------------------------------------------------------------
class PerExampleOnly(FlatClipping):
    refuses_user_level = "it reads each example alone"


class ScalesToC(FlatClipping):
    needs_finite_clip = True


class Searching(Step):
    queries_losses = True


class Weighing(Poisson):
    weighs_examples = True


class GridNoise(ConstantNoise):
    """Not a DiscreteGaussian: it declares an integer grid, so the run is secure and the clipping is built on it."""

    def __init__(self, noise_multiplier: float | None = None) -> None:
        super().__init__(noise_multiplier)
        self.grid = IntegerGrid(1e-3)

    @property
    def integer_grid(self) -> IntegerGrid:
        return self.grid


class OwnPlan(Step):
    """Implements ``plan``: a step with its own noise or ledger rule, as far as the hooks tell."""

    def plan(self, setup: StepSetup) -> StepPlan:
        del setup
        return StepPlan()


class PlanOnlyRefuses(OwnPlan):
    """Its ``plan`` only checks settings: it declares that it brings no rule of its own."""

    @property
    def brings_own_rules(self) -> bool:
        return False


class ReadsSums(Step):
    needs_sums = True


class AdaptsBound(Step):
    def clip_bound(self, configured: float) -> float:
        return configured


class KeepsBound(AdaptsBound):
    @property
    def adapts_clip_bound(self) -> bool:
        return False


# -- each decision reads its capability ------------------------------------------------------------------------
def test_a_slot_that_declares_a_user_level_reason_is_refused_with_it():
    with pytest.raises(
        DPConfigurationError,
        match=r"^DPStrategy: PerExampleOnly cannot be used with user-level DP in this version: it reads each "
        r"example alone\. Use the default slot",
    ):
        DPStrategy(**USERS, clipping=PerExampleOnly())
    DPStrategy(**USERS, clipping=FlatClipping())  # no reason declared: priced over users
    DPStrategy(clipping=PerExampleOnly())  # an example-level run does not ask


def test_a_clipping_that_needs_a_finite_bound_refuses_an_infinite_one():
    with pytest.raises(
        DPConfigurationError, match="max_grad_norm=inf with ScalesToC: each example's gradient"
    ):
        DPStrategy(noise_multiplier=0.0, max_grad_norm=math.inf, clipping=ScalesToC())
    with pytest.warns(UserWarning, match="no privacy"):
        DPStrategy(noise_multiplier=0.0, max_grad_norm=math.inf, clipping=FlatClipping())
    DPStrategy(max_grad_norm=2.0, clipping=ScalesToC())


def test_a_step_that_queries_losses_and_a_sampler_that_weighs_refuse_augmented_views():
    with pytest.raises(
        DPConfigurationError, match="augmentation_multiplicity=2 with Searching: its step-size"
    ):
        DPStrategy(augmentation_multiplicity=2, step=Searching())
    with pytest.raises(DPConfigurationError, match="with Weighing: Weighing weighs and bounds each sampled"):
        DPStrategy(augmentation_multiplicity=2, sampler=Weighing())
    DPStrategy(augmentation_multiplicity=2, step=HeavyBall(), sampler=Poisson())
    DPStrategy(augmentation_multiplicity=2, sampler=CyclicPoisson(bands=1))  # its weigh only checks the step


def test_a_noise_slot_on_an_integer_grid_makes_the_run_secure():
    assert PrivacyConfig(noise=GridNoise(1.0)).is_secure
    assert not PrivacyConfig(noise=ConstantNoise(1.0)).is_secure
    strategy = DPStrategy(noise=GridNoise(1.0))
    assert type(strategy.engine.clipping) is GridClipping
    assert strategy.engine.clipping.integer_grid is strategy.engine.noise.integer_grid
    DPStrategy(secure=True, noise=GridNoise(1.0))  # it is the secure noise: nothing to replace
    with pytest.raises(DPConfigurationError, match="secure=True with noise=ConstantNoise"):
        DPStrategy(secure=True, noise=ConstantNoise(1.0))


@pytest.mark.parametrize(
    ("step", "refused"),
    [(OwnPlan(), True), (ReadsSums(), True), (PlanOnlyRefuses(), False), (HeavyBall(), False)],
)
def test_correlated_and_secure_noise_read_whether_the_step_releases_one_gradient(step, refused):
    correlated = {"sampler": CyclicPoisson(4), "noise": BandMF()}
    name = step.name
    if refused:
        with pytest.raises(DPConfigurationError, match=f"BandMF cannot be combined with step={name}"):
            DPStrategy(**correlated, step=step)
        with pytest.raises(DPConfigurationError, match=f"secure=True with step={name}: that step brings"):
            DPStrategy(secure=True, step=step)
        return
    with pytest.warns(UserWarning, match="optimised for the prefix sums of plain SGD"):
        DPStrategy(**correlated, step=step)
    DPStrategy(secure=True, step=step)


def test_a_joint_statistic_reads_whether_the_step_sets_the_clipping_bound():
    with pytest.raises(
        DPConfigurationError, match="QuantileClipping cannot be combined with step=AdaptsBound"
    ):
        DPStrategy(noise_multiplier=1.0, clipping=QuantileClipping(), step=AdaptsBound())
    DPStrategy(noise_multiplier=1.0, clipping=QuantileClipping(), step=KeepsBound())


def test_the_shipped_slots_declare_what_the_tables_said():
    from lightning_dp import BLT, DPIS, AdaCliP, AdaptiveGD, AutoClipping, L1Clipping

    reasons = {type(s).__name__: s.refuses_user_level for s in (L1Clipping(), AdaCliP(), BandMF(), BLT())}
    reasons |= {type(s).__name__: s.refuses_user_level for s in (LineSearch(), AdaptiveGD())}
    assert all(reasons.values()), reasons
    assert all(s.refuses_user_level is None for s in (FlatClipping(), ConstantNoise(1.0), Poisson(), Step()))
    assert AutoClipping().needs_finite_clip
    assert not FlatClipping().needs_finite_clip
    assert DPIS().weighs_examples
    assert not CyclicPoisson(4).weighs_examples
    assert LineSearch().queries_losses
    assert AdaptiveGD().queries_losses
    assert not HeavyBall().queries_losses
    assert not LineSearch().releases_one_gradient
    assert Step().releases_one_gradient
