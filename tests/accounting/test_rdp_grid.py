"""The dense RDP order grid, the vectorised subsampled-Gaussian RDP, its cached bound, and the tight conversions."""

import math

import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant
from hypothesis import given, settings
from hypothesis import strategies as st
from opacus.accountants.analysis.rdp import compute_rdp

from lightning_dp.accounting import (
    DEFAULT_ORDERS,
    PoissonGaussian,
    PrivacyFilter,
    PrivacyLedger,
    compute_epsilon,
    epsilon_from_rdp,
    epsilon_from_rho,
    rho_from_epsilon,
)
from lightning_dp.accounting.rdp import EXACT_RUN, SPARSE_ORDERS, event_rdp, segment_rdp
from lightning_dp.accounting.sgm import GRID_STEPS_PER_OCTAVE, grid_params, sgm_rdp, sgm_rdp_bound

DELTA = 1e-5


@pytest.mark.parametrize("sigma", [0.7, 1.5, 5.0, 20.0])
@pytest.mark.parametrize("q", [1e-4, 0.04, 0.5])
def test_vectorised_rdp_matches_opacus(sigma, q):
    orders = SPARSE_ORDERS[::3]
    ours = sgm_rdp(sigma, q, orders)
    theirs = np.asarray(compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(orders)))
    # Both sum the same series in log space; tiny values near α = 1 differ by rounding (~1e-16 of ln A).
    np.testing.assert_allclose(ours, theirs, rtol=1e-9, atol=1e-12)


def test_integer_orders_past_1024_match_dp_accounting_where_it_is_finite():
    orders = (1500.0, 2048.0)
    theirs = rdp_privacy_accountant._compute_rdp_poisson_subsampled_gaussian(0.001, 20.0, orders)
    np.testing.assert_allclose(sgm_rdp(20.0, 0.001, orders), theirs, rtol=1e-9)


def test_dense_grid_is_tighter_at_small_epsilon():
    kw = {"noise_multiplier": 5.0, "sample_rate": 1e-4, "steps": 10_000, "delta": DELTA}
    dense, sparse = compute_epsilon(**kw), compute_epsilon(**kw, orders=SPARSE_ORDERS)
    assert dense < sparse / 1.8  # the sparse grid over-reported ε by ~90 % here (issue #17)
    # ... and within ~1 % of every integer order up to 1200 (the optimum is near 460).
    fine = tuple(float(a) for a in range(2, 1201))
    assert dense <= compute_epsilon(**kw, orders=fine) * 1.02
    assert set(SPARSE_ORDERS) <= set(DEFAULT_ORDERS)  # so the dense grid is never looser


@settings(max_examples=25, deadline=None)
@given(sigma=st.floats(0.3, 30.0), log_q=st.floats(-9.0, -0.01))
def test_grid_bound_never_underestimates(sigma, log_q):
    q = math.exp(log_q)
    s, p = grid_params(sigma, q)
    assert s <= sigma
    assert q <= p <= 1.0
    assert s >= sigma * 2 ** (-1.001 / GRID_STEPS_PER_OCTAVE)
    assert p <= q * 2 ** (1.001 / GRID_STEPS_PER_OCTAVE)
    orders = SPARSE_ORDERS[::7]
    exact = sgm_rdp(sigma, q, orders)
    assert np.all(sgm_rdp_bound(sigma, q, orders) >= exact * (1 - 1e-12))


def test_runs_are_exact_from_exact_run_and_monotone_in_count():
    event = PoissonGaussian(1.1, 0.02)
    exact = event_rdp(event, DEFAULT_ORDERS)
    previous = np.zeros(len(DEFAULT_ORDERS))
    for count in (1, 2, EXACT_RUN - 1, EXACT_RUN, EXACT_RUN + 1, 2 * EXACT_RUN, 10 * EXACT_RUN):
        run = segment_rdp(event, count, DEFAULT_ORDERS)
        assert np.all(run >= count * exact)
        assert np.all(run >= previous)
        previous = run
    np.testing.assert_array_equal(segment_rdp(event, 10 * EXACT_RUN, DEFAULT_ORDERS), 10 * EXACT_RUN * exact)


def test_per_step_schedule_is_an_upper_bound_close_to_exact():
    sigmas = np.linspace(1.5, 0.9, 100)
    ledger = PrivacyLedger(DELTA)
    for s in sigmas:
        ledger.record(PoissonGaussian(float(s), 0.01))
    exact = sum(PoissonGaussian(float(s), 0.01).rdp(DEFAULT_ORDERS) for s in sigmas)
    exact_eps = epsilon_from_rdp(exact, DEFAULT_ORDERS, DELTA)[0]
    assert exact_eps <= ledger.epsilon() <= exact_eps * 1.003


def test_rdp_conversion_is_dp_accountings():
    rdp = 300 * sgm_rdp(1.1, 0.02, DEFAULT_ORDERS)
    eps, order = rdp_privacy_accountant.compute_epsilon(DEFAULT_ORDERS, rdp, DELTA)
    assert epsilon_from_rdp(rdp, DEFAULT_ORDERS, DELTA) == pytest.approx((eps, order), rel=1e-12)


@pytest.mark.parametrize(
    ("rho", "delta"), [(1e-5, 1e-5), (0.01, 1e-8), (1 / 32, 1e-8), (0.5, 1e-5), (5.0, 1e-6)]
)
def test_zcdp_conversion_is_the_rdp_conversion_minimised_over_all_orders(rho, delta):
    orders = np.linspace(1.0001, 3000.0, 1_000_000)
    on_a_grid = epsilon_from_rdp(orders * rho, orders, delta)[0]
    got = epsilon_from_rho(rho, delta)
    assert got <= on_a_grid * (1 + 1e-12)
    assert got == pytest.approx(on_a_grid, rel=1e-6)
    assert got < epsilon_from_rho(rho, delta, "bun_steinke")


@settings(max_examples=30, deadline=None)
@given(eps=st.floats(0.01, 50.0), delta=st.sampled_from([1e-5, 1e-8, 1e-12]))
def test_rho_from_epsilon_round_trips_within_target(eps, delta):
    rho = rho_from_epsilon(eps, delta)
    assert eps * (1 - 1e-9) <= epsilon_from_rho(rho, delta) <= eps
    assert rho >= rho_from_epsilon(eps, delta, "bun_steinke")


def test_zcdp_filter_uses_the_tight_conversion():
    f = PrivacyFilter(1.0, 1e-8)
    assert f.rho_budget() == rho_from_epsilon(1.0, 1e-8)
    assert f.rho_budget() > 1.29 * PrivacyFilter(1.0, 1e-8, conversion="bun_steinke").rho_budget()
    with pytest.raises(ValueError, match="conversion"):
        PrivacyFilter(1.0, 1e-8, conversion="gdp")  # type: ignore[arg-type]
