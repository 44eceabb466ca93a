"""accountant="pld": Google's dp-accounting PLD accountant behind the ledger, calibration and the strategy."""

import importlib.util
import math

import dp_accounting
import pytest
from dp_accounting.pld import pld_privacy_accountant

from lightning_dp import PrivacyConfig
from lightning_dp.accounting import (
    BudgetExceededError,
    PLDNumericalError,
    PoissonGaussian,
    PrivacyLedger,
    PRVNumericalError,
    PureDP,
    calibrate_noise,
    compute_epsilon,
)
from lightning_dp.slots.compatibility import check_mechanisms

DELTA = 1e-5
HISTORY = [((2.0, 0.01), 150), ((4.0, 0.02), 60), ((2.0, 0.01), 40)]  # σ ≥ 2: cheap PLD grids


def _ledger(accountant: str) -> PrivacyLedger:
    ledger = PrivacyLedger(DELTA, accountant)  # type: ignore[arg-type]
    for (sigma, q), n in HISTORY:
        ledger.record(PoissonGaussian(sigma, q), n)
    return ledger


def test_pld_is_dp_accounting_and_sits_below_rdp_and_near_prv():
    theirs = pld_privacy_accountant.PLDAccountant()
    for (sigma, q), n in HISTORY:
        theirs.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), n)
    pld = _ledger("pld").epsilon()
    assert pld == pytest.approx(theirs.get_epsilon(DELTA), rel=1e-9)  # ours merges the equal runs
    assert pld < _ledger("rdp").epsilon()
    assert pld == pytest.approx(_ledger("prv").epsilon(), abs=0.03)  # PRV includes its eps_error=0.01


def test_pld_golden_value_between_rdp_and_opacus_prv():
    golden = {"noise_multiplier": 1.5, "sample_rate": 0.04, "steps": 2250, "delta": DELTA}
    pld = compute_epsilon(**golden, accountant="pld")
    assert pld < compute_epsilon(**golden)  # RDP: 7.3291
    assert pld == pytest.approx(compute_epsilon(**golden, accountant="prv"), abs=0.02)  # PRV: 6.779


def test_pld_check_before_spend_and_affordable_count():
    ledger = PrivacyLedger(DELTA, "pld")
    event = PoissonGaussian(2.0, 0.01)
    ledger.spend(event, target_epsilon=0.3, count=50)
    n = ledger.affordable_count(event, 0.3)
    assert ledger.epsilon_if(event, n) <= 0.3 < ledger.epsilon_if(event, n + 1)
    with pytest.raises(BudgetExceededError):
        ledger.spend(event, target_epsilon=0.3, count=n + 1)
    assert ledger.steps == 50  # the refused spend recorded nothing
    with pytest.raises(ValueError, match="PLD accountant cannot price"):
        ledger.record(PureDP(0.1))


def test_calibrate_pld_never_overshoots_and_needs_less_noise_than_rdp():
    kw = {"delta": DELTA, "sample_rate": 0.02, "steps": 100}
    sigma = calibrate_noise(target_epsilon=0.5, accountant="pld", **kw)
    assert compute_epsilon(noise_multiplier=sigma, accountant="pld", **kw) <= 0.5
    assert compute_epsilon(noise_multiplier=sigma * 0.98, accountant="pld", **kw) > 0.5
    assert sigma < calibrate_noise(target_epsilon=0.5, **kw)


def test_pld_numerical_errors_are_prv_numerical_errors():
    assert issubclass(PLDNumericalError, PRVNumericalError)  # so calibration and the search treat them alike
    assert (
        compute_epsilon(noise_multiplier=0.0, sample_rate=0.1, steps=3, delta=DELTA, accountant="pld")
        == math.inf
    )


def test_missing_dp_accounting_is_named_with_the_fix(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "dp_accounting" else real(name, *a)
    )
    with pytest.raises(ImportError, match="pip install dp-accounting"):
        PrivacyLedger(DELTA, "pld")


def test_strategy_and_engine_accept_pld():
    assert PrivacyConfig(target_epsilon=3.0, delta=DELTA, accountant="pld").accountant == "pld"
    from lightning_dp.clipping.flat import FlatClipping
    from lightning_dp.noise.constant import ConstantNoise
    from lightning_dp.sampling import Poisson

    check_mechanisms(Poisson(), FlatClipping(), ConstantNoise(), "pld")
