"""The zCDP, pure-DP and SVT events (``accounting/zcdp.py``, ``pure_dp.py``, ``laplace_mechanism.py``,
``noisy_min.py``, ``svt.py``; DP-AGD spec §3, line-search spec §3.3-3.6): ρ and ε conversions, their RDP curves,
ρ of events, and the events' round trip through dicts. The filters that spend them are tested in
``tests/accounting/test_filter.py``."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.special import logsumexp

from lightning_dp.accounting import (
    ZCDP,
    Gaussian,
    GaussianSVT,
    LaplaceMechanism,
    LaplaceSVT,
    NoisyMin,
    PoissonGaussian,
    PrivacyEvent,
    PureDP,
    epsilon_from_rho,
    rho_from_epsilon,
    zcdp_rho,
)
from lightning_dp.accounting.laplace_mechanism import laplace_rdp
from lightning_dp.accounting.pure_dp import pure_dp_rdp
from lightning_dp.accounting.zcdp import gaussian_std_for_rho

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
