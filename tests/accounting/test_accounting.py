"""Tests for lightning_dp.accounting: golden values, independent cross-checks, ledger semantics."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import io
import itertools
import math
import warnings
from dataclasses import dataclass

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from hypothesis import given, settings
from hypothesis import strategies as st
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.utils import get_noise_multiplier
from scipy import integrate

from lightning_dp.accounting import (
    DEFAULT_ORDERS,
    BudgetExceededError,
    Gaussian,
    PoissonGaussian,
    PrivacyEvent,
    PrivacyLedger,
    PRVNumericalError,
    calibrate_noise,
    compute_epsilon,
    epsilon_from_rdp,
)
from lightning_dp.accounting.prv import prv_epsilon
from lightning_dp.accounting.rdp import EXACT_RUN

DELTA = 1e-5
GOLDEN = {"noise_multiplier": 1.5, "sample_rate": 0.04, "steps": 2250, "delta": DELTA}
GOLDEN_RDP = 7.32911117143  # opacus tests/accountants_test.py
GOLDEN_PRV = 6.777395712150674  # idem (computed with an older scipy; we get 6.7791)


@dataclass(frozen=True)
class PureDP(PrivacyEvent, kind="test_pure_dp"):
    """A pure ε-DP release (e.g. Laplace), to show new event types plug in without touching the ledger."""

    epsilon: float

    def rdp(self, orders: tuple[float, ...]) -> np.ndarray:
        """ε-DP implies (α, min(ε, αε²/2))-RDP (Bun & Steinke 2016)."""
        a = np.asarray(orders)
        return np.minimum(self.epsilon, a * self.epsilon**2 / 2)


def _dp_event(sigma: float, q: float) -> dp_accounting.DpEvent:
    gaussian = dp_accounting.GaussianDpEvent(sigma)
    return gaussian if q == 1.0 else dp_accounting.PoissonSampledDpEvent(q, gaussian)


def _ledger(history, accountant="rdp", delta=DELTA):
    ledger = PrivacyLedger(delta, accountant)
    for (sigma, q), n in history:
        ledger.record(PoissonGaussian(sigma, q), n)
    return ledger


# ----------------------------------------------------------------------------- golden values
def test_golden_rdp_epsilon():
    eps = compute_epsilon(**GOLDEN)
    assert eps == pytest.approx(GOLDEN_RDP, abs=1e-8)
    # The extra large orders must not change the answer here (the optimum is an interior order).
    eps_opacus_orders = compute_epsilon(**GOLDEN, orders=RDPAccountant.DEFAULT_ALPHAS)
    assert eps == eps_opacus_orders
    opacus = RDPAccountant()
    opacus.history = [(1.5, 0.04, 2250)]
    assert eps == pytest.approx(opacus.get_epsilon(DELTA), rel=1e-12)


def test_golden_prv_epsilon():
    eps = compute_epsilon(**GOLDEN, accountant="prv")
    assert eps == pytest.approx(GOLDEN_PRV, abs=1e-2)
    assert eps < GOLDEN_RDP
    opacus = PRVAccountant()
    opacus.history = [(1.5, 0.04, 2250)]
    assert eps == pytest.approx(opacus.get_epsilon(DELTA), rel=1e-9)


def test_extended_orders_tighten_small_epsilon():
    # ε ≈ 0.1: the optimum order is beyond opacus's 63, so the extra orders give a tighter (valid) bound.
    ledger = _ledger([((10.875, 0.01), 1000)])
    eps, order = ledger.epsilon_and_order()
    assert order > 63
    eps_opacus_orders = compute_epsilon(
        noise_multiplier=10.875,
        sample_rate=0.01,
        steps=1000,
        delta=DELTA,
        orders=RDPAccountant.DEFAULT_ALPHAS,
    )
    assert eps < 0.1 < eps_opacus_orders
    sigma = calibrate_noise(target_epsilon=0.1, delta=DELTA, sample_rate=0.01, steps=1000)
    assert compute_epsilon(noise_multiplier=sigma, sample_rate=0.01, steps=1000, delta=DELTA) <= 0.1


def test_calibrate_golden_matches_opacus():
    sigma = calibrate_noise(target_epsilon=8, delta=DELTA, sample_rate=0.04, steps=2250)
    assert sigma == pytest.approx(1.416, rel=0.01)
    assert compute_epsilon(noise_multiplier=sigma, sample_rate=0.04, steps=2250, delta=DELTA) <= 8
    tight = calibrate_noise(target_epsilon=8, delta=DELTA, sample_rate=0.04, steps=2250, tol=1e-4)
    opacus = get_noise_multiplier(target_epsilon=8, target_delta=DELTA, sample_rate=0.04, steps=2250)
    assert tight == pytest.approx(opacus, abs=2e-3)
    assert tight <= sigma


@settings(max_examples=12, deadline=None)
@given(
    target=st.floats(0.5, 10.0),
    sample_rate=st.floats(1e-3, 0.2),
    steps=st.integers(1, 5000),
    delta=st.sampled_from([1e-4, 1e-5, 1e-6]),
)
def test_calibrated_sigma_never_overshoots(target, sample_rate, steps, delta):
    tol = 0.01
    sigma = calibrate_noise(target_epsilon=target, delta=delta, sample_rate=sample_rate, steps=steps, tol=tol)
    kw = {"sample_rate": sample_rate, "steps": steps, "delta": delta}
    assert compute_epsilon(noise_multiplier=sigma, **kw) <= target
    # ... and it is the smallest such σ up to tol: a σ below the bracket misses the target.
    assert compute_epsilon(noise_multiplier=sigma * (1 - tol) * 0.999, **kw) > target


def test_calibrate_prv_never_overshoots():
    kw = {"delta": DELTA, "sample_rate": 0.05, "steps": 200}
    sigma = calibrate_noise(target_epsilon=2.0, accountant="prv", **kw)
    assert compute_epsilon(noise_multiplier=sigma, accountant="prv", **kw) <= 2.0
    assert sigma <= calibrate_noise(target_epsilon=2.0, **kw)  # PRV is tighter than RDP


# ------------------------------------------------------------------ independent cross-checks
HISTORIES = [
    [((1.5, 0.04), 2250)],
    [((1.0, 0.01), 1000)],
    [((0.8, 0.2), 200)],
    [((3.0, 1.0), 5)],
    [((1.1, 0.02), 300), ((2.0, 0.05), 100), ((1.1, 0.02), 50)],
    [((0.9, 0.001), 5000), ((4.0, 0.3), 20)],
    [((1.1, 0.02), 300), ((2.0, 0.05), 200), ((1.1, 0.02), 150)],
]


INTEGER_ORDERS = tuple(a for a in DEFAULT_ORDERS if float(a).is_integer())


@pytest.mark.parametrize("history", HISTORIES)
def test_rdp_matches_dp_accounting(history):
    # At integer orders both libraries evaluate the same finite binomial sum exactly.
    ours = PrivacyLedger(DELTA, orders=INTEGER_ORDERS)
    theirs = rdp_privacy_accountant.RdpAccountant(orders=list(INTEGER_ORDERS))
    for (sigma, q), n in history:
        ours.record(PoissonGaussian(sigma, q), n)
        theirs.compose(_dp_event(sigma, q), n)
    eps, order = theirs.get_epsilon_and_optimal_order(DELTA)
    if min(n for _, n in history) >= EXACT_RUN:
        assert ours.epsilon() == pytest.approx(eps, rel=1e-9)
        assert ours.epsilon_and_order()[1] == order
    else:  # a run shorter than EXACT_RUN is priced by the grid bound: never below, at most ~0.3 % above
        assert eps * (1 - 1e-9) <= ours.epsilon() <= eps * (1 + 3e-3)
    # At fractional orders dp_accounting sums |terms| of the alternating series, a looser upper bound
    # (up to ~15% larger at α = 1.1); ours (Opacus's signed series) is exact, so never looser.
    full = rdp_privacy_accountant.RdpAccountant(orders=list(DEFAULT_ORDERS))
    for (sigma, q), n in history:
        full.compose(_dp_event(sigma, q), n)
    slack = 1e-9 if min(n for _, n in history) >= EXACT_RUN else 3e-3  # the short-run grid bound
    assert _ledger(history).epsilon() <= full.get_epsilon(DELTA) * (1 + slack)


@pytest.mark.parametrize(
    ("q", "sigma", "alpha"), [(0.04, 1.5, 1.1), (0.04, 1.5, 2.5), (0.2, 0.8, 1.3), (0.5, 0.5, 4.5)]
)
def test_fractional_order_rdp_matches_direct_integration(q, sigma, alpha):
    # RDP of the sampled Gaussian = 1/(α-1) log E_{x~N(0,σ²)}[((1-q) + q·exp((2x-1)/(2σ²)))^α].
    def integrand(x):
        ratio = (1 - q) + q * np.exp((2 * x - 1) / (2 * sigma**2))
        return np.exp(-(x**2) / (2 * sigma**2)) / (sigma * math.sqrt(2 * math.pi)) * ratio**alpha

    value, _ = integrate.quad(integrand, -60 * sigma, 60 * sigma, limit=1000, epsabs=0, epsrel=1e-12)
    expected = math.log(value) / (alpha - 1)
    assert PoissonGaussian(sigma, q).rdp((alpha,))[0] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("history", HISTORIES[2:5])
def test_prv_matches_dp_accounting_pld(history):
    ours = _ledger(history, accountant="prv").epsilon()
    pld = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)
    for (sigma, q), n in history:
        pld.compose(_dp_event(sigma, q), n)
    theirs = pld.get_epsilon(DELTA)
    # Both are upper bounds; PRV's includes its eps_error=0.01 slack.
    assert theirs - 5e-3 <= ours <= theirs + 0.03
    assert ours <= _ledger(history).epsilon()


def test_gaussian_is_poisson_gaussian_with_q_one():
    np.testing.assert_allclose(
        Gaussian(2.0).rdp(DEFAULT_ORDERS), PoissonGaussian(2.0, 1.0).rdp(DEFAULT_ORDERS), rtol=1e-12
    )
    ledger = PrivacyLedger(DELTA, "prv")
    ledger.record(Gaussian(3.0), 5)
    assert ledger.epsilon() == pytest.approx(
        _ledger([((3.0, 1.0), 5)], accountant="prv").epsilon(), rel=1e-12
    )


# ------------------------------------------------------------------------------- ledger
def test_heterogeneous_history_is_sum_of_parts():
    a, b = PoissonGaussian(1.1, 0.02), PoissonGaussian(2.0, 0.05)
    ledger = PrivacyLedger(DELTA)
    for _ in range(EXACT_RUN + 30):
        ledger.record(a)
    ledger.record(b, EXACT_RUN + 10)
    ledger.record(a, EXACT_RUN + 5)
    assert ledger.history == [(a, EXACT_RUN + 30), (b, EXACT_RUN + 10), (a, EXACT_RUN + 5)]
    assert ledger.steps == len(ledger) == 3 * EXACT_RUN + 45
    # Runs of EXACT_RUN or more are priced exactly.
    expected = (2 * EXACT_RUN + 35) * a.rdp(DEFAULT_ORDERS) + (EXACT_RUN + 10) * b.rdp(DEFAULT_ORDERS)
    np.testing.assert_allclose(ledger.rdp, expected, rtol=1e-12)
    assert ledger.epsilon() == pytest.approx(epsilon_from_rdp(expected, DEFAULT_ORDERS, DELTA)[0], rel=1e-12)
    # Shorter runs: an upper bound at every order, whose ε is within 0.3 % of the exact one.
    short = _ledger([((1.1, 0.02), 30), ((2.0, 0.05), 10), ((1.1, 0.02), 5)])
    exact = 35 * a.rdp(DEFAULT_ORDERS) + 10 * b.rdp(DEFAULT_ORDERS)
    assert np.all(short.rdp >= exact)
    exact_eps = epsilon_from_rdp(exact, DEFAULT_ORDERS, DELTA)[0]
    assert exact_eps <= short.epsilon() <= exact_eps * 1.003
    # PRV: order does not matter, equal (σ, q) segments are merged.
    prv_ledger = _ledger([((1.1, 0.02), 30), ((2.0, 0.05), 10), ((1.1, 0.02), 5)], accountant="prv")
    assert prv_ledger.epsilon() == prv_epsilon([(a, 35), (b, 10)], DELTA)


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_ledger_equals_compute_epsilon_for_constant_events(accountant):
    event = PoissonGaussian(1.3, 0.03)
    ledger = PrivacyLedger(DELTA, accountant)
    for _ in range(400):
        ledger.record(event)
    kw = {
        "noise_multiplier": 1.3,
        "sample_rate": 0.03,
        "steps": 400,
        "delta": DELTA,
        "accountant": accountant,
    }
    assert ledger.epsilon() == compute_epsilon(**kw)
    spent = PrivacyLedger(DELTA, accountant)
    assert spent.spend(event, target_epsilon=100.0, count=400) == spent.epsilon() == ledger.epsilon()


def test_epsilon_read_is_cheap(monkeypatch):
    """Reading ε after a record prices only the open run: the closed history is never re-priced, and the
    event's RDP curve (the costly part) is evaluated once, however many times the run grows."""
    from lightning_dp.accounting import events, rdp
    from lightning_dp.accounting import ledger as ledger_module

    counts = {"segment": 0, "curve": 0}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    ledger = PrivacyLedger(DELTA)
    for i in range(50):  # a long closed history of distinct events
        ledger.record(PoissonGaussian(1.0 + i / 100, 0.01), 3)
    ledger.epsilon()
    event = PoissonGaussian(0.987, 0.0123)  # a curve no other test has cached
    rdp.event_rdp.cache_clear()
    rdp.event_rdp_bound.cache_clear()
    monkeypatch.setattr(ledger_module, "segment_rdp", counting("segment", ledger_module.segment_rdp))
    monkeypatch.setattr(events, "sgm_rdp", counting("curve", events.sgm_rdp))
    monkeypatch.setattr(rdp, "sgm_rdp_bound", counting("curve", rdp.sgm_rdp_bound))
    for _ in range(1000):
        ledger.record(event)  # invalidates the cache, so every read recomputes
        ledger.epsilon()
    assert counts["segment"] == 1000  # one run priced per read: the open one
    assert counts["curve"] <= 2  # the grid bound and the exact curve, each once
    at_once = PrivacyLedger(DELTA)
    for i in range(50):
        at_once.record(PoissonGaussian(1.0 + i / 100, 0.01), 3)
    at_once.record(event, 1000)
    assert ledger.epsilon() == at_once.epsilon()


def test_zero_noise_zero_rate_and_empty():
    assert PrivacyLedger(DELTA).epsilon() == 0.0
    assert compute_epsilon(noise_multiplier=0.0, sample_rate=0.1, steps=1, delta=DELTA) == math.inf
    assert (
        compute_epsilon(noise_multiplier=0.0, sample_rate=0.1, steps=1, delta=DELTA, accountant="prv")
        == math.inf
    )
    assert compute_epsilon(noise_multiplier=1.0, sample_rate=0.0, steps=10, delta=DELTA) == 0.0
    assert compute_epsilon(noise_multiplier=1.0, sample_rate=0.1, steps=0, delta=DELTA) == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eps, order = epsilon_from_rdp([math.inf] * 3, (2.0, 4.0, 8.0), DELTA)
    assert eps == math.inf
    assert math.isnan(order)


def test_epsilon_at_other_delta():
    ledger = _ledger([((1.5, 0.04), 2250)])
    assert ledger.epsilon(1e-3) < ledger.epsilon() < ledger.epsilon(1e-7)
    assert ledger.epsilon(1e-3) == compute_epsilon(**{**GOLDEN, "delta": 1e-3})


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_affordable_count_is_exact(accountant, monkeypatch):
    event = PoissonGaussian(1.0, 0.05)
    target = 3.0
    ledger = PrivacyLedger(DELTA, accountant)
    ledger.record(PoissonGaussian(2.0, 0.1), 10)
    n = ledger.affordable_count(event, target)
    assert n > 0
    assert ledger.epsilon_if(event, n) <= target < ledger.epsilon_if(event, n + 1)
    assert ledger.can_afford(event, target, n)
    assert not ledger.can_afford(event, target, n + 1)
    # Cached per step: after spending k of the same event, the answer drops by k, cheaply.
    ledger.spend(event, target, count=3)
    searches = []
    search = ledger._affordable_count
    monkeypatch.setattr(ledger, "_affordable_count", lambda *a: searches.append(a) or search(*a))
    for _ in range(100):
        assert ledger.affordable_count(event, target) == n - 3
    assert searches == []  # answered from the cache, no ε evaluated
    ledger.spend(event, target, count=n - 3)
    assert ledger.epsilon() <= target
    assert ledger.affordable_count(event, target) == 0
    with pytest.raises(BudgetExceededError):
        ledger.spend(event, target)


def test_affordable_count_cache_matches_fresh_search():
    event = PoissonGaussian(1.2, 0.02)
    ledger = PrivacyLedger(DELTA)
    first = ledger.affordable_count(event, 4.0)
    for _ in range(1, 50):
        ledger.record(event)
        fresh = PrivacyLedger(DELTA)
        fresh.load_state_dict(ledger.state_dict())
        assert ledger.affordable_count(event, 4.0) == fresh.affordable_count(event, 4.0)
    assert ledger.affordable_count(event, 4.0) == first - 49
    # A different event in between invalidates the cache.
    other = PoissonGaussian(0.8, 0.1)
    ledger.record(other, 5)
    fresh = PrivacyLedger(DELTA)
    fresh.load_state_dict(ledger.state_dict())
    assert ledger.affordable_count(event, 4.0) == fresh.affordable_count(event, 4.0)
    # A costless event fits "forever"; nothing fits once the ledger is over target.
    assert PrivacyLedger(DELTA).affordable_count(PoissonGaussian(1.0, 0.0), 4.0) >= 2**62
    assert ledger.affordable_count(event, ledger.epsilon() / 2) == 0


def test_spend_refuses_and_leaves_history_unchanged():
    event = PoissonGaussian(1.0, 0.05)
    ledger = PrivacyLedger(DELTA)
    ledger.spend(event, target_epsilon=3.0, count=10)
    before = (ledger.history, ledger.steps, ledger.epsilon())
    with pytest.raises(BudgetExceededError, match="target") as info:
        ledger.spend(event, target_epsilon=3.0, count=10_000)
    err = info.value
    assert err.spent == before[2]
    assert err.target == 3.0
    assert err.would_be > 3.0
    assert err.count == 10_000
    assert f"{before[2]:.6g}" in str(err)
    assert (ledger.history, ledger.steps, ledger.epsilon()) == before


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_state_dict_round_trip_through_torch_weights_only(accountant):
    ledger = PrivacyLedger(DELTA, accountant)
    a, b = PoissonGaussian(1.1, 0.02), Gaussian(5.0)
    for _ in range(77):
        ledger.record(a)
    ledger.record(b, 2)
    ledger.record(a, 13)
    buffer = io.BytesIO()
    torch.save(ledger.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    restored = PrivacyLedger(DELTA, accountant)
    restored.load_state_dict(state)
    assert restored.history == ledger.history
    assert restored.steps == ledger.steps
    assert restored.epsilon() == ledger.epsilon()
    assert restored.epsilon_if(a, 5) == ledger.epsilon_if(a, 5)
    assert restored.state_dict() == ledger.state_dict()


def test_state_dict_refuses_mismatch():
    ledger = _ledger([((1.0, 0.01), 10)])
    with pytest.raises(ValueError, match="delta"):
        PrivacyLedger(1e-6).load_state_dict(ledger.state_dict())
    with pytest.raises(ValueError, match="accountant"):
        PrivacyLedger(DELTA, "prv").load_state_dict(ledger.state_dict())
    bad = ledger.state_dict()
    bad["history"][0]["event"]["kind"] = "no_such_mechanism"
    target = _ledger([((2.0, 0.01), 3)])
    with pytest.raises(ValueError, match="unknown privacy event kind"):
        target.load_state_dict(bad)
    assert target.steps == 3  # a failed load leaves the ledger untouched


def test_custom_event_type_plugs_in():
    ledger = PrivacyLedger(DELTA)
    ledger.record(PureDP(0.1), 3)
    ledger.record(PoissonGaussian(1.0, 0.01), 100)
    state = ledger.state_dict()
    assert state["history"][0]["event"] == {"kind": "test_pure_dp", "epsilon": 0.1}
    restored = PrivacyLedger(DELTA)
    restored.load_state_dict(state)
    assert restored.epsilon() == ledger.epsilon()
    assert (
        0
        < ledger.epsilon()
        < 0.3 + compute_epsilon(noise_multiplier=1.0, sample_rate=0.01, steps=100, delta=DELTA)
    )
    with pytest.raises(ValueError, match="accountant='rdp'"):
        PrivacyLedger(DELTA, "prv").record(PureDP(0.1))
    with pytest.raises(ValueError, match="accountant='rdp'"):
        prv_epsilon([(PureDP(0.1), 1)], DELTA)


def test_prv_numerical_failure_is_an_error_not_nan():
    with pytest.raises(PRVNumericalError, match="accountant='rdp'"):
        compute_epsilon(noise_multiplier=0.3, sample_rate=0.5, steps=1000, delta=DELTA, accountant="prv")
    # RDP still prices it (a huge but finite ε).
    assert 100 < compute_epsilon(noise_multiplier=0.3, sample_rate=0.5, steps=1000, delta=DELTA) < math.inf


def test_epsilon_curve_and_summary():
    ledger = _ledger([((1.1, 0.02), 300), ((2.0, 0.05), 100), ((1.1, 0.02), 50)])
    curve = ledger.epsilon_curve(num_points=40)
    steps, eps = zip(*curve)
    assert curve[0] == (0, 0.0)
    assert curve[-1] == (450, ledger.epsilon())
    assert len(curve) <= 40
    assert list(steps) == sorted(set(steps))
    assert all(e2 >= e1 for e1, e2 in itertools.pairwise(eps))
    partial = _ledger([((1.1, 0.02), 300), ((2.0, 0.05), 40)])
    assert dict(curve).get(340, partial.epsilon()) == pytest.approx(partial.epsilon(), rel=1e-12)
    summary = ledger.summary()
    assert summary == {
        "epsilon": ledger.epsilon(),
        "delta": DELTA,
        "accountant": "rdp",
        "steps": 450,
        "best_order": ledger.epsilon_and_order()[1],
    }
    assert "best_order" not in PrivacyLedger(DELTA, "prv").summary()
    assert PrivacyLedger(DELTA).epsilon_curve() == [(0, 0.0)]


def test_prv_epsilon_curve():
    ledger = _ledger([((1.0, 0.1), 40), ((2.0, 0.1), 20)], accountant="prv")
    curve = ledger.epsilon_curve(num_points=6)  # default is 25 for PRV: each point is a PRV evaluation
    assert [step for step, _ in curve] == [0, 12, 24, 36, 48, 60]
    assert curve[0] == (0, 0.0)
    assert curve[-1] == (60, ledger.epsilon())
    eps = [e for _, e in curve]
    assert all(e2 >= e1 - 1e-9 for e1, e2 in itertools.pairwise(eps))


def test_events_are_hashable_values():
    assert PoissonGaussian(1, 0.5) == PoissonGaussian(1.0, 0.5)
    assert hash(PoissonGaussian(1, 0.5)) == hash(PoissonGaussian(1.0, 0.5))
    assert PoissonGaussian(1.0, 1.0) != Gaussian(1.0)
    event = PoissonGaussian(1.5, 0.04)
    assert PrivacyEvent.from_dict(event.to_dict()) == event
    assert isinstance(event.to_dict()["noise_multiplier"], float)
    with pytest.raises(AttributeError):
        event.noise_multiplier = 2.0  # type: ignore[misc]


# ----------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: PoissonGaussian(-1.0, 0.1), "noise_multiplier"),
        (lambda: PoissonGaussian(float("nan"), 0.1), "noise_multiplier"),
        (lambda: PoissonGaussian(1.0, 1.5), "sample_rate"),
        (lambda: PoissonGaussian(1.0, -0.1), "sample_rate"),
        (lambda: Gaussian(-2.0), "noise_multiplier"),
        (lambda: PrivacyLedger(0.0), "delta"),
        (lambda: PrivacyLedger(1.0), "delta"),
        (lambda: PrivacyLedger(DELTA, accountant="gdp"), "accountant"),
        (lambda: PrivacyLedger(DELTA, orders=[0.5, 2.0]), "orders"),
        (lambda: PrivacyLedger(DELTA).record(PoissonGaussian(1.0, 0.1), -1), "count"),
        (lambda: PrivacyLedger(DELTA).record(1.0), "event"),
        (lambda: PrivacyLedger(DELTA).affordable_count(PoissonGaussian(1.0, 0.1), -1.0), "target_epsilon"),
        (lambda: PrivacyLedger(DELTA).epsilon(delta=2.0), "delta"),
        (lambda: PrivacyLedger(DELTA).epsilon_curve(num_points=1), "num_points"),
        (lambda: compute_epsilon(noise_multiplier=1.0, sample_rate=0.1, steps=-1, delta=DELTA), "steps"),
        (lambda: compute_epsilon(noise_multiplier=1.0, sample_rate=0.1, steps=10, delta=0), "delta"),
        (lambda: calibrate_noise(target_epsilon=0, delta=DELTA, sample_rate=0.1, steps=10), "target_epsilon"),
        (lambda: calibrate_noise(target_epsilon=1, delta=1.5, sample_rate=0.1, steps=10), "delta"),
        (lambda: calibrate_noise(target_epsilon=1, delta=DELTA, sample_rate=0.0, steps=10), "sample_rate"),
        (lambda: calibrate_noise(target_epsilon=1, delta=DELTA, sample_rate=1.1, steps=10), "sample_rate"),
        (lambda: calibrate_noise(target_epsilon=1, delta=DELTA, sample_rate=0.1, steps=0), "steps"),
        (lambda: calibrate_noise(target_epsilon=1, delta=DELTA, sample_rate=0.1, steps=10, tol=0), "tol"),
        (
            lambda: calibrate_noise(target_epsilon=1, delta=DELTA, sample_rate=0.1, steps=10, accountant="x"),
            "accountant",
        ),
    ],
)
def test_bad_inputs_name_the_parameter(make, name):
    with pytest.raises(ValueError, match=name):
        make()


def test_unreachable_target_explains_what_to_do():
    with pytest.raises(ValueError, match="fewer steps") as info:
        calibrate_noise(target_epsilon=0.5, delta=DELTA, sample_rate=1.0, steps=10**10)
    assert "noise_multiplier=10000" in str(info.value)
