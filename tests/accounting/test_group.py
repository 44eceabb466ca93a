"""The user-level ε of an example-level run whose users own at most k examples (spec user_level.md, Table E).

Both bounds reproduce the spec's digits, computed there with dp-accounting 0.6.0 and TF Privacy's
group-privacy code: the mixture-of-Gaussians PLD (tight) to 1e-9 relative, the group-RDP bound exactly on
lightning-dp's own RDP curve, and ∞ (never an exception) where δ_e underflows.
"""

from __future__ import annotations

import math

import pytest

from lightning_dp.accounting import PoissonGaussian, PrivacyLedger, compute_epsilon
from lightning_dp.accounting.group import (
    group_rdp_user_epsilon,
    mog_user_epsilon,
    mog_user_epsilon_of_history,
)


def _ledger(sigma: float, q: float, steps: int) -> PrivacyLedger:
    ledger = PrivacyLedger(delta=1e-5)
    ledger.record(PoissonGaussian(sigma, q), steps)
    return ledger


@pytest.mark.parametrize(
    ("k", "expected"),
    [(1, 5.367640841572282), (2, 15.35589468457847), (4, 84.9452082019422), (8, math.inf)],
)
def test_group_rdp_reproduces_table_e1_and_reports_inf_where_delta_e_underflows(
    k: int, expected: float
) -> None:
    assert group_rdp_user_epsilon(_ledger(1.0, 0.05, 200), k, 1e-5) == expected


@pytest.mark.parametrize(
    ("k", "expected"),
    [(1, 2.985922185845464), (2, 7.02715591916974), (5, 28.23437369776121), (10, 110.7963813012941)],
)
def test_group_rdp_reproduces_table_e2_the_digits_demo(k: int, expected: float) -> None:
    ledger = _ledger(2.828, 128 / 1257, 300)
    assert group_rdp_user_epsilon(ledger, k, 1e-5) == pytest.approx(expected, rel=1e-12)
    if k == 1:  # one example per user: the user-level ε is the example-level ε
        assert group_rdp_user_epsilon(ledger, 1, 1e-5) == compute_epsilon(
            noise_multiplier=2.828, sample_rate=128 / 1257, steps=300, delta=1e-5
        )


def test_group_rdp_grows_with_k_and_is_zero_for_an_empty_ledger() -> None:
    ledger = _ledger(2.0, 0.01, 100)
    values = [group_rdp_user_epsilon(ledger, k, 1e-5) for k in (1, 2, 3, 4)]
    assert values == sorted(values)
    assert group_rdp_user_epsilon(PrivacyLedger(delta=1e-5), 3, 1e-5) == 0.0
    with pytest.raises(ValueError, match="integer >= 1"):
        group_rdp_user_epsilon(ledger, 0, 1e-5)


def test_mog_pld_reproduces_table_e_digits() -> None:
    pytest.importorskip("dp_accounting")
    # E2, k = 1: the example-level PLD ε of the demo (the mixture has one component)
    assert mog_user_epsilon(2.828, 128 / 1257, 1, 300, 1e-5) == pytest.approx(2.7370744618307876, rel=1e-9)
    # E1 σ sweep, k = 8, σ = 8: a real mixture of nine Gaussians
    assert mog_user_epsilon(8.0, 0.05, 8, 200, 1e-5) == pytest.approx(3.0095104117496785, rel=1e-9)


def test_mog_refuses_events_it_has_no_bound_for_and_handles_edge_histories() -> None:
    from lightning_dp.accounting import LaplaceMechanism

    assert mog_user_epsilon_of_history([], 3, 1e-5) == 0.0
    assert mog_user_epsilon(0.0, 0.1, 3, 10, 1e-5) == math.inf
    with pytest.raises(ValueError, match="Poisson-subsampled Gaussian"):
        mog_user_epsilon_of_history([(LaplaceMechanism(0.5), 3)], 2, 1e-5)
