"""The privacy filters (``accounting/filter.py``): the zCDP filter of DP-AGD (spec T8) and the RDP filter of the
line search (spec §3.7-3.8). The events they spend are tested in ``tests/accounting/test_zcdp.py``."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lightning_dp.accounting import (
    ZCDP,
    BudgetExceededError,
    Gaussian,
    LaplaceSVT,
    PrivacyFilter,
)


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
