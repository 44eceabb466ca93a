"""The privacy filter and the zCDP / pure-DP / SVT events (DP-AGD spec §3, line-search spec §3.3-3.8)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.special import logsumexp

from lightning_dp.accounting import (
    ZCDP,
    BudgetExceededError,
    Gaussian,
    GaussianSVT,
    LaplaceMechanism,
    LaplaceSVT,
    NoisyMin,
    PoissonGaussian,
    PrivacyEvent,
    PrivacyFilter,
    PureDP,
    epsilon_from_rho,
    rho_from_epsilon,
    zcdp_rho,
)
from lightning_dp.accounting.zcdp import gaussian_std_for_rho, laplace_rdp, pure_dp_rdp

ORDERS = (1.5, 2.0, 3.0, 5.0, 10.0, 32.0, 100.0, 500.0)


# -- conversions (DP-AGD spec T1-T4) -------------------------------------------------------------
@pytest.mark.parametrize(
    ("eps", "delta", "rho"),
    [
        (0.05, 1e-8, 3.388329e-05),
        (0.1, 1e-8, 1.353499e-04),
        (0.2, 1e-8, 5.399409e-04),
        (0.4, 1e-8, 2.148211e-03),
        (0.8, 1e-8, 8.502247e-03),
        (1.0, 1e-8, 1.3215363e-02),
        (1.6, 1e-8, 3.331190e-02),
        (0.05, 1e-12, 2.259906e-05),
        (0.8, 1e-12, 5.708252e-03),
        (1.6, 1e-12, 2.251508e-02),
        (1.0, 1e-5, 0.02081993834),
    ],
)
def test_rho_closed_form_matches_table_root_finder_and_round_trip(eps, delta, rho):
    got = rho_from_epsilon(eps, delta, "bun_steinke")
    assert got == pytest.approx(rho, rel=2e-6)
    root = brentq(
        lambda r: epsilon_from_rho(r, delta, "bun_steinke") - eps, 0.0, eps, xtol=1e-300, rtol=1e-15
    )
    assert got == pytest.approx(root, rel=1e-10)
    assert epsilon_from_rho(got, delta, "bun_steinke") == pytest.approx(eps, abs=1e-12)


def test_rho_for_epsilon_one_delta_1e8():
    assert rho_from_epsilon(1.0, 1e-8, "bun_steinke") == pytest.approx(0.0132154, abs=5e-8)
    assert rho_from_epsilon(1.0, 1e-8, "bun_steinke") == pytest.approx(0.01321536285, rel=1e-9)


def test_lemma_3_8_forward_and_gaussian_std():
    assert epsilon_from_rho(0.01, 1e-8, "bun_steinke") == pytest.approx(0.868386410515739, rel=1e-12)
    assert epsilon_from_rho(1 / 32, 1e-8, "bun_steinke") == pytest.approx(1.5486771293851465, rel=1e-12)
    assert epsilon_from_rho(0.5, 1e-5, "bun_steinke") == pytest.approx(5.298525912188081, rel=1e-12)
    assert gaussian_std_for_rho(0.01, 3) == pytest.approx(21.21320344, rel=1e-9)
    assert gaussian_std_for_rho(1e-4, 3) == pytest.approx(212.1320344, rel=1e-9)
    assert gaussian_std_for_rho(0.5, 1) == 1.0
    assert gaussian_std_for_rho(1 / 32, 1) == 4.0


# -- RDP curves ------------------------------------------------------------------------------------
def _renyi(p: np.ndarray, q: np.ndarray, a: float) -> float:
    keep = (p > 0) & (q > 0)
    return float(logsumexp(a * np.log(p[keep]) + (1 - a) * np.log(q[keep])) / (a - 1))


@pytest.mark.parametrize("eps", [0.01, 0.3, 1.0, 4.0])
def test_pure_dp_curve_is_the_randomized_response_bound_capped(eps):
    p = np.array([math.exp(eps), 1.0]) / (1 + math.exp(eps))
    curve = pure_dp_rdp(ORDERS, eps)
    for a, value in zip(ORDERS, curve, strict=True):
        exact_rr = _renyi(p, p[::-1], a)  # randomised response: the worst ε-DP pair
        assert value == pytest.approx(min(exact_rr, eps, a * eps**2 / 2), rel=1e-9, abs=1e-15)
        assert value <= eps + 1e-15
        assert value <= a * eps**2 / 2 + 1e-15


@pytest.mark.parametrize("e", [0.05, 0.5, 2.0])
def test_laplace_rdp_matches_numerical_divergence(e):
    x = np.linspace(-60 / e, 60 / e, 400_001)
    dx = x[1] - x[0]
    p = 0.5 * e * np.exp(-e * np.abs(x)) * dx
    q = 0.5 * e * np.exp(-e * np.abs(x - 1.0)) * dx
    for a, value in zip((1.5, 2.0, 5.0, 10.0), laplace_rdp((1.5, 2.0, 5.0, 10.0), e), strict=True):
        assert value == pytest.approx(_renyi(p, q, a), rel=2e-3)
        assert value <= e
    event = LaplaceMechanism(e)
    assert np.all(event.rdp(ORDERS) <= pure_dp_rdp(ORDERS, e) + 1e-15)


def test_noisy_min_and_svt_curves():
    eps = 0.5
    a = np.asarray(ORDERS)
    assert np.allclose(NoisyMin(eps).rdp(ORDERS), pure_dp_rdp(ORDERS, eps))
    assert NoisyMin(eps).zcdp() == pytest.approx(eps**2 / 2)
    assert NoisyMin(eps, "gumbel").zcdp() == pytest.approx(eps**2 / 8)
    assert np.all(NoisyMin(eps, "gumbel").rdp(ORDERS) <= a * eps**2 / 8 + 1e-15)
    assert NoisyMin.epsilon_for_rho(3.4722222e-05) == pytest.approx(8.33333e-3, rel=1e-6)
    paper = LaplaceSVT(eps, max_queries=10, accounting="paper").rdp(ORDERS)
    safe = LaplaceSVT(eps, max_queries=10).rdp(ORDERS)
    assert np.allclose(paper, 2 * laplace_rdp(ORDERS, eps / 2))
    assert np.all(safe <= eps + 1e-15)
    expected = np.minimum.reduce(
        [
            pure_dp_rdp(ORDERS, eps),
            eps / 2 + laplace_rdp(ORDERS, eps / 2),
            math.log(11) / (a - 1) + 2 * laplace_rdp(ORDERS, eps / 2),
        ]
    )
    assert np.allclose(safe, expected)
    rho = 0.01
    assert np.allclose(GaussianSVT(rho, 10, "paper").rdp(ORDERS), a * rho)
    assert np.allclose(GaussianSVT(rho, 10).rdp(ORDERS), math.log(11) / (a - 1) + 4 / 3 * a * rho)
    assert GaussianSVT(rho, 10).zcdp() is None
    assert GaussianSVT(rho, 10, "paper").zcdp() == rho


def test_zcdp_rho_of_events():
    assert zcdp_rho(Gaussian(4.0)) == 1 / 32
    assert zcdp_rho(PoissonGaussian(4.0, 0.01)) == 1 / 32  # sampling ignored: conservative
    assert zcdp_rho(PoissonGaussian(4.0, 0.0)) == 0.0
    assert zcdp_rho(ZCDP(0.125)) == 0.125
    assert zcdp_rho(PureDP(0.5)) == 0.125
    assert zcdp_rho(LaplaceSVT(0.5, 3)) is None


@pytest.mark.parametrize(
    "event",
    [
        ZCDP(0.1),
        PureDP(0.3),
        LaplaceMechanism(0.2),
        NoisyMin(0.1, "laplace"),
        LaplaceSVT(0.2, 5, "paper"),
        GaussianSVT(0.01, 4),
    ],
)
def test_events_round_trip_through_dicts(event):
    assert PrivacyEvent.from_dict(event.to_dict()) == event


# -- the zCDP filter (DP-AGD spec T8) ---------------------------------------------------------------
def _agd_iteration(f: PrivacyFilter) -> bool:
    """One iteration without rejection: gradient 0.125 then NoisyMin 0.25, each checked before spend."""
    if not f.can_afford(ZCDP(0.125)):
        return False
    f.spend(ZCDP(0.125))
    if not f.can_afford(ZCDP(0.25)):
        return False
    f.spend(ZCDP(0.25))
    return True


def test_zcdp_filter_exhaustion_exact_arithmetic():
    f = PrivacyFilter(None, 1e-8, rho=1.0)
    assert _agd_iteration(f)
    assert _agd_iteration(f)
    assert not _agd_iteration(f)  # gradient fits (0.875), NoisyMin does not
    assert f.rho_spent == 0.875
    with pytest.raises(BudgetExceededError):
        f.spend(ZCDP(0.25))
    assert f.rho_spent == 0.875  # nothing recorded by the refused spend
    g = PrivacyFilter(None, 1e-8, rho=1.125)
    assert _agd_iteration(g)
    assert _agd_iteration(g)
    assert _agd_iteration(g)
    assert g.rho_spent == 1.125  # exactly the budget: accepted (<=)
    assert not g.can_afford(ZCDP(0.125))


def test_zcdp_filter_reserve_counts_iterations_and_refuses_useless_gradient():
    f = PrivacyFilter(None, 1e-8, rho=1.0, reserve=ZCDP(0.25))
    assert f.affordable_count(ZCDP(0.125)) == 2
    f.spend(ZCDP(0.125))
    f.spend(ZCDP(0.25))
    f.spend(ZCDP(0.125))
    f.spend(ZCDP(0.25))
    assert f.affordable_count(ZCDP(0.125)) == 0  # 0.875 fits, but not with its NoisyMin
    assert f.can_afford(ZCDP(0.125))


def test_zcdp_filter_target_and_reporting():
    f = PrivacyFilter(1.0, 1e-8, conversion="bun_steinke")
    assert f.rho_budget() == pytest.approx(0.01321536285, rel=1e-9)
    rho_ng0, rho_nmax = 9.311990306e-07, 3.4722222e-05
    for _ in range(100):  # T7: 100 iterations without rejections
        f.spend(ZCDP(rho_ng0))
        f.spend(ZCDP(rho_nmax))
    assert f.rho_spent == pytest.approx(3.5653421253e-03, rel=1e-7)
    assert f.epsilon() == pytest.approx(0.51611204, rel=1e-6)
    assert f.epsilon_if(ZCDP(0.0)) == pytest.approx(f.epsilon())
    with pytest.raises(ValueError, match="zCDP privacy filter cannot price"):
        f.spend(LaplaceSVT(0.1, 5))
    curve = f.epsilon_curve(5)
    assert curve[-1][1] == pytest.approx(f.epsilon())
    assert curve[0] == (0, 0.0)
    g = PrivacyFilter(1.0, 1e-8)
    g.load_state_dict(f.state_dict())
    assert g.rho_spent == f.rho_spent
    with pytest.raises(ValueError, match="target_epsilon"):
        PrivacyFilter(2.0, 1e-8).load_state_dict(f.state_dict())
    with pytest.raises(ValueError, match="mode"):
        PrivacyFilter(1.0, 1e-8, mode="rdp").load_state_dict(f.state_dict())


# -- the RDP filter (line-search spec §3.7-3.8) -------------------------------------------------------
def test_rdp_filter_budgets_paper_and_strict():
    paper = PrivacyFilter(0.2, 1e-8, mode="rdp_paper", orders=(100.0, 500.0))
    assert paper.rdp_budgets() == pytest.approx([0.013933, 0.163085], abs=1e-6)
    strict = PrivacyFilter(0.05, 1e-8, mode="rdp", orders=tuple(float(a) for a in range(2, 501)))
    assert strict.rdp_budgets()[-1] == pytest.approx(0.000635, abs=1e-6)


def test_rdp_filter_runs_while_some_order_fits_and_reports_union_bound():
    orders = (2.0, 8.0, 32.0, 128.0)
    f = PrivacyFilter(1.0, 1e-5, mode="rdp", orders=orders)
    budgets = f.rdp_budgets()
    event = Gaussian(30.0)  # α/1800 per release
    n = f.affordable_count(event)
    per_order = np.floor(budgets / (np.asarray(orders) / 1800.0))
    assert n == int(per_order.max())
    f.spend(event, count=n)
    assert not f.can_afford(event)
    with pytest.raises(BudgetExceededError):
        f.spend(event)
    eps = f.epsilon()
    assert eps <= 1.0
    a = np.asarray(orders)
    direct = f.rdp + math.log(len(orders) / 1e-5) / (a - 1)
    assert eps == pytest.approx(direct[f.rdp <= budgets].min())
    # the paper's rule (no ln|Λ|) lets more through than the strict one
    assert PrivacyFilter(1.0, 1e-5, mode="rdp_paper", orders=orders).affordable_count(event) > n
