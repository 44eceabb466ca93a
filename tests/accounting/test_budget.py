"""Check-before-spend (``accounting/budget.py``'s ``charge``): every release of every mechanism is checked
before it is spent, and a refusal names the mechanism."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TinyModule, make_trainer

from lightning_dp import DPIS, DPConfigurationError, DPStrategy, LineSearch
from lightning_dp.accounting import (
    ZCDP,
    BudgetExceededError,
    Gaussian,
    PoissonGaussian,
    PrivacyFilter,
    PrivacyLedger,
    charge,
)
from lightning_dp.clipping import FlatClipping
from lightning_dp.noise import ConstantNoise
from lightning_dp.slots import SamplerRuntime
from lightning_dp.slots.release import Releases
from recipes import DigitsDataModule
from recipes.dp_pca import ComposedNoise, DPPCAClassifier


def test_charge_records_within_budget_and_refuses_by_name_recording_nothing():
    ledger = PrivacyLedger(delta=1e-5)
    eps = charge(ledger, Gaussian(5.0), 1.0, mechanism="a noisy mean")
    assert ledger.steps == 1
    assert eps == pytest.approx(ledger.epsilon())
    with pytest.raises(BudgetExceededError, match="a noisy histogram would overspend") as info:
        charge(ledger, Gaussian(0.5), 1.0, mechanism="a noisy histogram")
    assert info.value.mechanism == "a noisy histogram"
    assert info.value.would_be > 1.0 >= info.value.spent
    assert ledger.steps == 1  # nothing recorded
    # No budget (σ given, ε only reported): recorded whatever it costs.
    assert charge(ledger, Gaussian(0.5), None, mechanism="unbudgeted") > 1.0
    assert ledger.steps == 2


def test_charge_applies_a_filter_rule_without_an_explicit_target():
    flt = PrivacyFilter(target_epsilon=1.0, delta=1e-6, mode="zcdp")
    charge(flt, ZCDP(1e-3), None, mechanism="a measurement")
    with pytest.raises(BudgetExceededError, match="a big measurement") as info:
        charge(flt, ZCDP(10.0), None, mechanism="a big measurement")
    assert info.value.mechanism == "a big measurement"
    assert flt.steps == 1


# -- DPIS: its per-epoch statistics ----------------------------------------------------------------
def _dpis(target: float | None, ledger: PrivacyLedger) -> DPIS:
    sampler = DPIS(k=3, seed=0, sigma_N=50.0, sigma_K=15.0)
    sampler.bind(400, 10)
    sampler.attach_runtime(
        SamplerRuntime(
            norms=lambda idx: torch.ones(len(idx), dtype=torch.float64),
            ledger=ledger,
            target_epsilon=target,
            delta=1e-5,
            planned_steps=400,
            steps_per_epoch=40,
            max_grad_norm=0.5,
            fixed_noise_multiplier=1.2,
            clipping=FlatClipping(),
        )
    )
    noise = ConstantNoise(1.2)
    sampler.use_releases(
        Releases(ledger, target_epsilon=target, noise=noise, clipping=FlatClipping(), gradient_name="DPIS")
    )
    return sampler


def test_dpis_statistic_over_budget_is_refused_by_name_and_not_released():
    ledger = PrivacyLedger(delta=1e-5)
    sampler = _dpis(1.0, ledger)
    sampler.n_tilde = 400.0  # as after the first epoch: the next start releases K~ only
    step = PoissonGaussian(1.0, 0.01)
    ledger.record(step, ledger.affordable_count(step, 1.0))  # one step fits no more
    assert ledger.epsilon() < 1.0 < ledger.epsilon_if(Gaussian(sampler.sigma_k))
    before = ledger.history
    with pytest.raises(BudgetExceededError, match="DPIS's K~ statistic") as info:
        sampler._start_epoch()
    assert info.value.mechanism == "DPIS's K~ statistic"
    assert ledger.history == before
    assert sampler.epochs == []


def test_dpis_pending_statistics_are_due_only_at_an_epoch_boundary():
    ledger = PrivacyLedger(delta=1e-5)
    sampler = _dpis(None, ledger)
    assert sampler.pending_events() == [Gaussian(sampler.sigma_n), Gaussian(sampler.sigma_k)]
    sampler._start_epoch()
    assert sampler.pending_events() == []
    sampler.consumed = 40
    assert sampler.pending_events() == [Gaussian(sampler.sigma_k)]


def test_dpis_with_fixed_sigma_stops_at_the_epoch_boundary_within_the_target(tmp_path):
    """σ given, target as a budget stop: on 2d4380a the next epoch's K~ was recorded unchecked, the run
    ended at ε = 1.0198 > 1 and then crashed blaming a missing PrivacyCallback."""
    module = TinyModule(n=400, batch_size=10)
    strategy = DPStrategy(
        sampler=DPIS(k=3, seed=0, sigma_N=50.0, sigma_K=15.0),
        seed=0,
        max_grad_norm=0.5,
        target_epsilon=1.0,
        noise_multiplier=1.2,
    )
    make_trainer(strategy, tmp_path, max_epochs=8).fit(module)
    assert strategy.epsilon <= 1.0
    assert strategy.engine.steps == 40  # one whole epoch; the second one's K~ and a step did not fit
    assert len(strategy.engine.sampler.epochs) == 1


# -- adaptive mechanisms need a budget fixed in advance -------------------------------------------------
def test_adaptive_line_search_without_a_target_is_refused():
    with pytest.raises(DPConfigurationError, match="budget fixed in advance"):
        DPStrategy(noise_multiplier=1.0, step=LineSearch(mode="adaptive"))
    DPStrategy(noise_multiplier=1.0, step=LineSearch(mode="nn"))  # fixed per-iteration cost: composition
    DPStrategy(target_epsilon=1.0, noise_multiplier=1.0, step=LineSearch(mode="adaptive"))


def test_report_of_a_filter_run_gives_the_budget_as_the_guarantee(tmp_path):
    module = TinyModule(n=200, batch_size=50)
    module.dp_per_sample_loss = lambda batch: torch.nn.functional.cross_entropy(  # type: ignore[method-assign]
        module(batch[0]), batch[1], reduction="none"
    )
    step = LineSearch(mode="adaptive", eta0=1.0, max_it=2, seed=0, planned_iterations=8)
    strategy = DPStrategy(target_epsilon=1.0, max_grad_norm=1.0, seed=0, step=step)
    make_trainer(strategy, tmp_path, max_steps=3).fit(module)
    report = json.loads((tmp_path / "privacy_report.json").read_text())
    assert report["epsilon"] == report["target_epsilon"] == 1.0
    assert 0 < report["realised_epsilon"] < 1.0
    assert report["realised_epsilon"] == pytest.approx(strategy.epsilon)
    assert "odometer" in report["realised_epsilon_kind"]


# -- a recipe's own release -------------------------------------------------------------------------
def test_dp_pca_release_is_checked_before_the_projection_is_computed(monkeypatch):
    data = DigitsDataModule(batch_size=64, flatten=True, val_fraction=0.0)
    model = DPPCAClassifier(pca_components=10, pca_noise_multiplier=0.5, in_features=64, hidden=[16])
    computed = []
    monkeypatch.setattr(model, "fit_projection", lambda *args: computed.append(args))
    strategy = DPStrategy(target_epsilon=1.0, noise=ComposedNoise(), seed=0)
    with pytest.raises(BudgetExceededError, match="DP-PCA projection would overspend") as info:
        make_trainer(strategy, max_epochs=1).fit(model, data)
    assert info.value.mechanism == "DP-PCA projection"
    assert computed == []  # nothing was released
    assert strategy.ledger.steps == 0
