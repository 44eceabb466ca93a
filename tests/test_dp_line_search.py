"""DP-BLSGD (Chen & Lee 2022): the spec's unit properties (specs/dp_line_search.md §6) with its numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from opacus.accountants.analysis.rdp import compute_rdp

from lightning_dp.steps.dp_line_search import (
    LineSearchGradient,
    LineSearchJoint,
    LineSearchSVT,
    amplify_general,
    angle_ema,
    candidate_steps,
    cheb_decision,
    clip_objective,
    gaussian_rdp_sgm,
    laplace_rdp,
    noisy_backtracking,
    pure_dp_amplified,
    pure_dp_rdp,
    pure_dp_rr,
    rdp_to_dp_prop1,
    reset_eta0,
    svt_calibration,
    svt_gaussian_rdp,
    svt_laplace_rdp,
)

# ------------------------------------------------------------------ 1-2. noise calibration


def test_p1_laplace_calibration():
    cal = svt_calibration("laplace", 0.002, 1.0)
    assert (cal.threshold_scale, cal.query_scale) == pytest.approx((1000, 2000))
    cal = svt_calibration("laplace", 1.0, 1.0)
    assert (cal.threshold_scale, cal.query_scale) == pytest.approx((2, 4))


def test_p2_gaussian_calibration_and_thm3():
    cal = svt_calibration("gaussian", 0.01, 1.0)
    assert (cal.threshold_scale**2, cal.query_scale**2) == pytest.approx((150, 300))
    assert svt_gaussian_rdp([10], 0.01, 11, "paper")[0] == pytest.approx(0.1)
    # NN split with ρ_iter = 0.5
    rho_grad, rho_bt = 0.9 * 0.5, 0.1 * 0.5
    assert 1 / math.sqrt(2 * rho_grad) == pytest.approx(1.054093, abs=1e-6)
    cal = svt_calibration("gaussian", rho_bt, 1.0)
    assert (cal.threshold_scale, cal.query_scale) == pytest.approx((5.477226, 7.745967), abs=1e-6)
    assert math.sqrt(2 * rho_bt) == pytest.approx(0.316228, abs=1e-6)


# ------------------------------------------------------------------ 3-5. SVT RDP


def test_p3_laplace_rdp_and_thm2():
    assert laplace_rdp([2], 0.5)[0] == pytest.approx(math.log(2 / 3 * math.exp(0.5) + 1 / 3 * math.exp(-1)))
    assert laplace_rdp([2], 0.5)[0] == pytest.approx(0.2003039, abs=1e-7)
    paper = svt_laplace_rdp([2, 10, 100], 1.0, 11, "paper")
    assert paper == pytest.approx([0.4006078, 0.8573808, 0.9860983], abs=1e-7)
    assert (paper < 1.0).all()
    assert svt_laplace_rdp([2], 0.002, 11, "paper")[0] == pytest.approx(1.99933e-6, rel=1e-5)


def test_p4_safe_laplace_svt():
    safe = svt_laplace_rdp([10], 1.0, 11)[0]
    assert safe == pytest.approx(0.9286904, abs=1e-7)
    assert 0.5 + laplace_rdp([10], 0.5)[0] == pytest.approx(safe)
    assert math.log(11) / 9 + 2 * laplace_rdp([10], 0.5)[0] == pytest.approx(1.1238, abs=1e-4)
    assert pure_dp_rr([10], 1.0)[0] == pytest.approx(0.9651931, abs=1e-7)
    assert pure_dp_rr([2], 1.0)[0] == pytest.approx(0.7353257, abs=1e-7)
    # the closed form equals the sinh definition
    a, e = 7.0, 0.3
    direct = math.log((math.sinh(a * e) - math.sinh((a - 1) * e)) / math.sinh(e)) / (a - 1)
    assert pure_dp_rr([a], e)[0] == pytest.approx(direct, rel=1e-12)
    assert svt_laplace_rdp([100], 0.002, 11)[0] == pytest.approx(1.98694e-4, rel=1e-5)
    assert svt_laplace_rdp([100], 0.002, 11, "paper")[0] == pytest.approx(9.98022e-5, rel=1e-5)


def test_p5_safe_gaussian_svt():
    assert svt_gaussian_rdp([10], 0.05, 11)[0] == pytest.approx(math.log(11) / 9 + 4 / 3 * 0.5)
    assert svt_gaussian_rdp([10], 0.05, 11)[0] == pytest.approx(0.933099, abs=1e-6)
    assert svt_gaussian_rdp([10], 0.05, 11, "paper")[0] == pytest.approx(0.5)


# ------------------------------------------------------------------ 6-8. amplification


@pytest.mark.parametrize(
    ("q", "alpha", "gen", "sgm"),
    [
        (0.01, 2, 1.718134e-4, 1.718134e-4),
        (0.01, 3, 2.847121e-4, 2.646376e-4),
        (0.01, 10, 0.0885884, 0.0382704),
        (0.005, 10, 4.810073e-4, 2.967662e-4),
    ],
)
def test_p6_amplification(q, alpha, gen, sgm):
    a_gen = amplify_general([alpha], lambda x: x * 0.5, q)[0]
    a_sgm = gaussian_rdp_sgm([alpha], 0.5, q)[0]
    assert a_gen == pytest.approx(gen, rel=1e-6)
    assert a_sgm == pytest.approx(sgm, rel=1e-6)
    assert a_sgm <= a_gen * (1 + 1e-12)
    if alpha == 2:
        assert a_gen == pytest.approx(math.log(1 + 1e-4 * (math.e - 1)), rel=1e-10)


def test_p6_sgm_never_above_general():
    orders = np.arange(2, 65, dtype=float)
    for q in (0.001, 0.02, 0.3):
        for rho in (1e-4, 0.05, 0.5, 2.0):
            gen = amplify_general(orders, lambda x, r=rho: x * r, q)
            assert (gaussian_rdp_sgm(orders, rho, q) <= gen * (1 + 1e-9)).all()


def test_p7_min_rule():
    q, rho = 0.1, 2e-6
    assert amplify_general([10], lambda x: x * rho, q)[0] == pytest.approx(0.0145963, rel=1e-5)
    cost = LineSearchGradient(rho, q).rdp((10.0, 100.0))
    assert cost[0] == pytest.approx(2.00001e-7, rel=1e-5)
    assert cost[0] < 10 * rho < amplify_general([10], lambda x: x * rho, q)[0]
    assert cost[1] == pytest.approx(2.000075e-6, rel=1e-5)
    assert cost[1] == pytest.approx(100 * q**2 * rho, rel=1e-4)
    # the paper charges Lemma 4 with no minimum
    assert LineSearchGradient(rho, q, "paper").rdp((10.0,))[0] == pytest.approx(0.0145963, rel=1e-5)
    # cross-check A_SGM against Opacus at q = 1: α·ρ
    assert gaussian_rdp_sgm([5], 0.3, 1.0)[0] == pytest.approx(1.5)


def test_p8_pure_dp_amplification():
    eps = pure_dp_amplified(0.002, 0.1)
    assert eps == pytest.approx(2.001801e-4, rel=1e-6)
    assert 100 * eps**2 / 2 == pytest.approx(2.003604e-6, rel=1e-6)
    assert pure_dp_rr([100], eps)[0] == pytest.approx(2.003471e-6, rel=1e-6)
    event = LineSearchSVT("laplace", 0.002, 0.1, 11)
    assert event.rdp((100.0,))[0] <= pure_dp_rdp([100], eps)[0]


def test_svt_event_is_minimum_of_valid_bounds():
    orders = (2.0, 2.5, 10.0, 64.0)
    event = LineSearchSVT("laplace", 0.5, 0.05, 11)
    base = svt_laplace_rdp(orders, 0.5, 11)
    assert (event.rdp(orders) <= base + 1e-15).all()
    assert (event.rdp(orders) <= pure_dp_rdp(orders, pure_dp_amplified(0.5, 0.05)) + 1e-15).all()
    gauss = LineSearchSVT("gaussian", 0.05, 0.05, 11)
    assert (gauss.rdp(orders) <= svt_gaussian_rdp(orders, 0.05, 11) + 1e-15).all()
    # events survive a checkpoint round trip
    for e in (event, gauss, LineSearchGradient(0.1, 0.05), LineSearchJoint(0.45, "laplace", 0.3, 0.005, 11)):
        assert type(e).from_dict(e.to_dict()) == e


# ------------------------------------------------------------------ 12-14. the search itself


def _quadratic_search(eps_bt: float, generator: torch.Generator, **kw) -> tuple:
    """Spec §6.12: ℓ(w) = w²/2, w = 2, d = 2, c = 0.5, η0 = 2, β = 0.8, C_obj = 10, m = 1."""
    w, d = 2.0, 2.0
    calls: list[float] = []

    def loss_at(i: int, eta: float) -> float:
        calls.append(eta)
        return min((w - eta * d) ** 2 / 2, 10.0)

    f0 = w**2 / 2
    cal = svt_calibration("laplace", eps_bt, 10.0)
    args = dict(eta0=2.0, beta=0.8, max_it=10, c=0.5, calibration=cal, generator=generator)
    args.update(kw)
    result = noisy_backtracking(f0, loss_at, d * d, **args)
    return result, calls


def test_p12_noise_free_armijo():
    result, calls = _quadratic_search(math.inf, torch.Generator().manual_seed(0))
    assert result.eta == pytest.approx(0.8192)
    assert result.index == 5
    assert result.evaluations == 5  # + 1 forward for F0
    assert calls == pytest.approx([2, 1.6, 1.28, 1.024, 0.8192])
    queries = [2 * e - 2 * e * e for e in calls]
    assert queries == pytest.approx([-4, -1.92, -0.7168, -0.049152, 0.29622272])


def test_p13_candidate_grid_and_fallback():
    grid = candidate_steps(1.0, 0.8, 10)
    assert grid[-1] == pytest.approx(0.134217728)
    calls: list[float] = []

    def never(i: int, eta: float) -> float:
        calls.append(eta)
        return 1e9

    cal = svt_calibration("laplace", math.inf, 1.0)
    g = torch.Generator().manual_seed(0)
    fail = noisy_backtracking(
        0.0, never, 1.0, eta0=1, beta=0.8, max_it=10, c=0.5, calibration=cal, generator=g
    )
    assert (fail.eta, fail.index, fail.evaluations, len(calls)) == (0.0, 0, 10, 10)
    nn = noisy_backtracking(
        0.0, never, 1.0, eta0=1, beta=0.8, max_it=10, c=0.5, calibration=cal, generator=g, on_fail="smallest"
    )
    assert nn.eta == pytest.approx(0.1073741824)
    assert nn.index == 0


@pytest.mark.parametrize("noise", ["laplace", "gaussian"])
def test_p14_vanishing_budget_accepts_half(noise):
    g = torch.Generator().manual_seed(1)
    cal = svt_calibration(noise, 1e-9, 1.0)
    runs = 10_000
    first = sum(
        noisy_backtracking(
            1.0, lambda i, e: 1.0, 1.0, eta0=1, beta=0.8, max_it=3, c=0.5, calibration=cal, generator=g
        ).index
        == 1
        for _ in range(runs)
    )
    assert first / runs == pytest.approx(0.5, abs=0.015)


def test_p14_large_budget_reproduces_armijo():
    result, _ = _quadratic_search(1e12, torch.Generator().manual_seed(3))
    assert result.index == 5


def test_laplace_draws_have_the_right_scale():
    from lightning_dp.steps.dp_line_search import draw_noise

    g = torch.Generator().manual_seed(0)
    x = np.array([draw_noise("laplace", 2.0, g) for _ in range(20_000)])
    assert np.mean(np.abs(x)) == pytest.approx(2.0, rel=0.03)  # E|Lap(b)| = b
    y = np.array([draw_noise("gaussian", 3.0, g) for _ in range(20_000)])
    assert y.std() == pytest.approx(3.0, rel=0.03)


# ------------------------------------------------------------------ 15. sensitivity of the query


def test_p15_query_sensitivity():
    g = torch.Generator().manual_seed(0)
    c_obj, m = 1.5, 7.0
    for _ in range(200):
        w, d = torch.randn(3, generator=g).double(), torch.randn(3, generator=g).double()
        x = torch.randn(6, 3, generator=g).double() * 3
        extra = torch.randn(1, 3, generator=g).double() * 3
        shift = float(torch.randn(1, generator=g))

        def losses(weights, data, s=shift):  # can exceed C_obj and be negative
            return (data @ weights) ** 2 - 1.0 + s

        for eta in (0.0, 0.3, 2.0, 10.0):

            def query(data, eta=eta, w=w, d=d):
                f0 = clip_objective(losses(w, data), c_obj).sum()
                f1 = clip_objective(losses(w - eta * d, data), c_obj).sum()
                return float(f0 - 0.5 * eta * float(d @ d) * m - f1)

            gap = abs(query(x) - query(torch.cat([x, extra])))
            assert gap <= c_obj + 1e-9
            assert gap / m <= c_obj / m + 1e-9


# ------------------------------------------------------------------ 16-20. post-processing rules


def test_p16_eta0_reset():
    eta0 = reset_eta0(1.0, [0.512, 0.64, 0.4096], 1.2)
    assert eta0 == pytest.approx(0.768)
    eta0 = reset_eta0(eta0, [0.6144], 1.2)
    assert eta0 == pytest.approx(0.73728)
    assert reset_eta0(eta0, [], 1.2) == eta0
    assert reset_eta0(0.5, [0.9], 1.2) == 0.5  # never increases by default
    assert reset_eta0(0.5, [0.9], 1.2, growth=True) == pytest.approx(1.08)


@pytest.mark.parametrize(
    ("d2", "theta", "outcome"),
    [((-1.0, 0.1), 174.29, "rho"), ((4.0, 1.0), 14.04, "search"), ((3.0, 4.0), 53.13, "none")],
)
def test_p17_cheb_branches(d2, theta, outcome):
    d = torch.tensor([1.0, 0.0])
    second = torch.tensor(d2)
    res = cheb_decision(d, second, theta_bar=90.0, rho_grad=1.0, eps_bt=1.0, xi=0.3, phi_max=1.1, phi_min=0.5)
    assert res.theta == pytest.approx(theta, abs=0.01)
    expected = {"rho": (1.3, 1.0), "search": (1.0, 1.3), "none": (1.0, 1.0)}[outcome]
    assert (res.rho_grad, res.eps_bt) == pytest.approx(expected)
    assert res.raised_rho == (outcome == "rho")
    if d2 == (3.0, 4.0):
        assert ((d + second) / 2).tolist() == [2.0, 2.0]


def test_p18_angle_ema():
    assert angle_ema(90.0, 60.0, 0.8) == pytest.approx(84.0)


def test_p20_objective_clipping():
    clipped = clip_objective(torch.tensor([0.5, 2.3, 1.0, -0.2]), 1.0)
    assert clipped.tolist() == [0.5, 1.0, 1.0, 0.0]
    assert float(clipped.sum()) == pytest.approx(2.5)


# ------------------------------------------------------------------ 21-22. conversion, NN accounting


def test_p21_conversion():
    assert rdp_to_dp_prop1(np.array([0.5]), [10], 1e-5) == pytest.approx(1.779214, abs=1e-6)
    from lightning_dp.accounting import epsilon_from_rdp

    assert epsilon_from_rdp([0.5], [10], 1e-5)[0] == pytest.approx(1.418011, abs=1e-6)


@pytest.mark.parametrize(
    ("steps", "dpsgd", "paper_joint", "mode_s"),
    [(6000, 3.6127, 4.0102, 3.3654), (200, 2.1061, 2.1429, 1.8952)],
)
def test_p22_nn_end_to_end_accounting(steps, dpsgd, paper_joint, mode_s):
    orders = tuple(float(a) for a in range(2, 257))
    q, rho, delta = 1 / 200, 0.5, 1e-8
    sgd = steps * np.asarray(compute_rdp(q=q, noise_multiplier=1.0, steps=1, orders=list(orders)))
    assert rdp_to_dp_prop1(sgd, orders, delta) == pytest.approx(dpsgd, abs=1e-4)
    joint = steps * LineSearchJoint(0.9 * rho, "gaussian", 0.1 * rho, q, 11, "paper").rdp(orders)
    assert rdp_to_dp_prop1(joint, orders, delta) == pytest.approx(paper_joint, abs=1e-4)
    eps_bt = math.sqrt(2 * 0.1 * rho)
    grad = LineSearchGradient(0.9 * rho, q).rdp(orders)
    pure_amp = pure_dp_rdp(orders, pure_dp_amplified(eps_bt, q))  # the spec's "pure-amp Laplace"
    assert rdp_to_dp_prop1(steps * (grad + pure_amp), orders, delta) == pytest.approx(mode_s, abs=1e-4)
    # our SVT event takes the minimum with more valid bounds: never above the spec's figure
    ours = steps * (grad + LineSearchSVT("laplace", eps_bt, q, 11).rdp(orders))
    assert rdp_to_dp_prop1(ours, orders, delta) <= mode_s + 1e-4
