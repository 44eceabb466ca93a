"""The one release path (lightning_dp/slots/release.py) and the slot contract (plans, declared hooks)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_dp import AdaptiveGD, ConstantNoise, DPConfigurationError, FlatClipping, Poisson, Step
from lightning_dp.accounting import (
    BudgetExceededError,
    Gaussian,
    PoissonGaussian,
    PrivacyFilter,
    PrivacyLedger,
)
from lightning_dp.engine import PrivateStepEngine
from lightning_dp.slots import StepPlan, StepSetup
from lightning_dp.slots.release import Releases


def _releases(target: float | None = 1.0, ledger: PrivacyLedger | None = None) -> Releases:
    return Releases(
        ledger if ledger is not None else PrivacyLedger(delta=1e-5),
        target_epsilon=target,
        noise=ConstantNoise(1.0),
        clipping=FlatClipping(),
        gradient_name="the toy gradient",
    )


def _engine(step: Step, noise: ConstantNoise | None = None, target: float | None = 2.0) -> PrivateStepEngine:
    return PrivateStepEngine(
        sampler=Poisson(seed=0),
        clipping=FlatClipping(),
        noise=noise if noise is not None else ConstantNoise(None),
        step=step,
        max_grad_norm=1.0,
        delta=1e-5,
        target_epsilon=target,
        accountant="rdp",
        loss_reduction="mean",
        seed=0,
    )


def test_spend_records_what_fits_and_refuses_by_name_recording_nothing():
    releases = _releases(target=1.0)
    releases.spend(Gaussian(50.0), mechanism="a toy count")
    assert releases.ledger.history == [(Gaussian(50.0), 1)]
    expensive = Gaussian(0.5)
    assert not releases.can_afford(expensive)
    with pytest.raises(BudgetExceededError, match="a toy count") as err:
        releases.spend(expensive, mechanism="a toy count")
    assert err.value.mechanism == "a toy count"
    assert releases.ledger.history == [(Gaussian(50.0), 1)]


def test_check_refuses_a_gradient_naming_the_release():
    releases = _releases(target=0.1)
    with pytest.raises(BudgetExceededError, match="the toy gradient") as err:
        releases.check(PoissonGaussian(0.5, 0.5))
    assert err.value.spent == 0.0
    assert releases.ledger.steps == 0
    _releases(target=None).check(PoissonGaussian(0.5, 0.5))  # no target: only reported, never refused


def test_a_filter_reserve_counts_for_gradients_only():
    """reserve=True (the gradient rule) keeps room for the filter's reserve; a plain query does not."""
    step_event, reserve = Gaussian(20.0), Gaussian(3.0)  # zCDP ρ = 1/800 and 1/18
    ledger = PrivacyFilter(5.0, 1e-5, mode="zcdp", reserve=reserve)
    releases = _releases(target=5.0, ledger=ledger)
    while releases.can_afford(step_event, reserve=True):  # as many as fit with the reserve after them
        ledger.record(step_event)
    assert ledger.steps > 100
    assert releases.can_afford(step_event)  # the reserve's room is still there for a query
    releases.spend(reserve, mechanism="the reserved query")


def test_noisy_adds_one_std_over_all_ranks_and_sums_them():
    """Each of W ranks adds std/√W, and the all-reduce sums: the released sum carries std once."""
    world, std, n = 4, 3.0, 200_000
    shares = []
    for rank in range(world):
        releases = _releases()
        releases.connect(rank, world, all_reduce=None)  # one process per rank: collect the shares
        shares.append(releases.noisy([torch.zeros(n)], std, torch.Generator().manual_seed(rank))[0])
    summed = _releases()
    summed.connect(0, world, all_reduce=lambda ts: [sum(shares)])
    released = summed.all_reduce([shares[0]])[0]
    assert float(released.std()) == pytest.approx(std, rel=0.02)
    assert _releases().broadcast([1.5, 2.0], torch.device("cpu")) == [1.5, 2.0]  # one process: as given


def test_a_step_plan_brings_its_noise_and_ledger_before_construction():
    step = AdaptiveGD()
    engine = _engine(step)
    assert isinstance(engine.ledger, PrivacyFilter)
    assert engine.noise.noise_multiplier(0) == pytest.approx(1.0 / math.sqrt(2.0 * step.rho_ng))
    assert engine.releases.ledger is engine.ledger


def test_plans_refuse_what_they_cannot_price():
    with pytest.raises(DPConfigurationError, match="do not pass noise or noise_multiplier"):
        _engine(AdaptiveGD(), noise=ConstantNoise(1.0))
    with pytest.raises(DPConfigurationError, match="needs target_epsilon"):
        _engine(AdaptiveGD(), target=None)


class _Planned(Step):
    """A step that declares its own σ and records what it was shown."""

    def __init__(self) -> None:
        self.seen: StepSetup | None = None
        self.bound = False

    def plan(self, setup: StepSetup) -> StepPlan:
        self.seen = setup
        return StepPlan(noise=ConstantNoise(0.75))

    def bind(self, host) -> None:
        self.bound = host.releases is not None

    def clip_bound(self, configured: float) -> float:
        return configured / 2


def test_a_custom_plan_and_clip_bound_are_what_the_engine_uses():
    step = _Planned()
    engine = _engine(step, noise=ConstantNoise(None))
    assert step.seen is not None
    assert step.seen.max_grad_norm == 1.0
    assert step.bound
    assert engine.noise_multiplier() == 0.75
    assert engine.max_grad_norm == 0.5


def test_noise_only_step_is_priced_and_releases_pure_noise():
    model = nn.Linear(3, 2)
    engine = _engine(Step(), noise=ConstantNoise(1.0), target=None)
    engine.sampler.bind(100, 10)
    engine.attach(model)
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)  # whatever was there before is dropped
    ctx = engine.noise_only_step()
    assert ctx.batch_size == 0
    assert engine.ledger.history == [(PoissonGaussian(1.0, 0.1), 1)]
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert float(grads.abs().max()) < 1.0  # noise of std σC/(qN) = 0.1 only: the stale 7s are gone
    assert float(grads.abs().min()) > 0.0


def test_connect_sets_the_collective_once_for_every_release():
    engine = _engine(Step(), noise=ConstantNoise(1.0), target=None)
    engine.connect(1, 2, all_reduce=lambda ts: [2 * t for t in ts])
    assert (engine.rank, engine.world_size) == (1, 2)
    assert engine.releases.rank == 1
    assert engine.releases.all_reduce([torch.ones(2)])[0].tolist() == [2.0, 2.0]


def test_a_statistic_carries_rank_zeros_draw_once_over_all_ranks():
    """Every rank draws (the streams stay aligned), only rank 0 adds its draw, and the sum is shared."""
    std, locals_ = 2.0, [3.0, 4.0]
    expected_noise = (
        float(torch.randn(1, generator=torch.Generator().manual_seed(5), dtype=torch.float64)) * std
    )
    other_rank = torch.tensor([locals_[1]], dtype=torch.float64)
    releases = _releases()
    releases.connect(0, 2, all_reduce=lambda ts: [ts[0] + other_rank])
    value = releases.noisy_statistic(locals_[0], std, torch.Generator().manual_seed(5))
    assert value == pytest.approx(sum(locals_) + expected_noise, rel=1e-12)
    releases.connect(1, 2, all_reduce=None)
    with pytest.raises(RuntimeError, match="all-reduce"):
        releases.noisy_statistic(1.0, std, torch.Generator())
