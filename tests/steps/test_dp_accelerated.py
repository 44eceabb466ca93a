"""DP-SHB, DP-NAG, DP-MASG and noise dividing (Kuru et al. 2020): the spec's unit properties (§6)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dp.accounting import PoissonGaussian, PrivacyLedger, SubsampledLaplace
from lightning_dp.accounting.subsampled_laplace import laplace_multiplier, subsampled_laplace_epsilon
from lightning_dp.noise.noise_dividing import (
    NoiseDividing,
    allocation_shares,
    gaussian_schedule,
    laplace_noise,
    laplace_schedule,
)
from lightning_dp.slots import StepContext
from lightning_dp.steps.dp_accelerated import (
    HeavyBall,
    MultiStageNesterov,
    Nesterov,
    masg_stage_lengths,
    nag_momentum,
)

S1, N = 40.0, 100_000


def _ctx(step: int) -> StepContext:
    return StepContext(step, 1, 1.0, 1.0, 0.0, torch.Generator())


def _scale(sigma: float, m: int) -> float:
    """Laplace scale b on the mean gradient for multiplier σ (scale on the sum is σ·S1)."""
    return sigma * S1 / m


# -- §6.1–6.3: amplified Laplace cost, Prop. 3.1, the allocation rule -------------------------------------
def test_amplified_laplace_cost():
    assert subsampled_laplace_epsilon(1000 * 0.04 / S1, 0.01) == pytest.approx(0.0170369, abs=1e-7)
    assert subsampled_laplace_epsilon(N * 0.04 / S1, 1.0) == pytest.approx(0.01, rel=1e-12)
    assert SubsampledLaplace(1.0, 0.01).pure_epsilon() == pytest.approx(math.log(1 + 0.01 * (math.e - 1)))


def test_uniform_paper_schedule_is_prop_3_1():
    sigmas = laplace_schedule(allocation_shares(np.zeros(100)), 1.0, 0.01)
    assert _scale(sigmas[0], 1000) == pytest.approx(0.0575000, abs=1e-7)
    spent = math.fsum(subsampled_laplace_epsilon(s, 0.01) for s in sigmas)
    assert spent == pytest.approx(1.0, abs=1e-9)
    assert spent <= 1.0
    full = laplace_schedule(allocation_shares(np.zeros(100)), 1.0, 1.0)
    assert _scale(full[0], N) == pytest.approx(0.04, rel=1e-9)
    long = laplace_schedule(allocation_shares(np.zeros(1000)), 1.0, 0.01)
    assert _scale(long[0], 1000) == pytest.approx(0.4194822, abs=1e-7)


def test_allocation_rule_a_1_8_27():
    shares = allocation_shares(np.log([1.0, 8.0, 27.0]))
    np.testing.assert_allclose(shares, [1 / 6, 1 / 3, 1 / 2], rtol=1e-12)
    full = [_scale(s, N) for s in laplace_schedule(shares, 1.0, 1.0)]
    np.testing.assert_allclose(full, [0.0024, 0.0012, 0.0008], rtol=1e-9)
    sub = laplace_schedule(shares, 1.0, 0.01)
    np.testing.assert_allclose(
        [_scale(s, 1000) for s in sub], [0.01355209, 0.01080260, 0.00955175], atol=1e-8
    )
    np.testing.assert_allclose([subsampled_laplace_epsilon(s, 0.01) for s in sub], [1 / 6, 1 / 3, 1 / 2])
    objective = float(np.dot([1, 8, 27], np.square(np.array(full) * N / S1)))
    assert objective == pytest.approx(216)
    assert 3 * 9 * 12 == 324


# -- §6.4: constant-α DP-NAG shares, and noise decreasing along the schedule ------------------------------
def test_nag_shares_and_decreasing_noise():
    beta = 0.9 / 1.1
    assert 2 * beta / (1 + beta) == pytest.approx(0.9)
    assert nag_momentum(0.1, 0.1) == pytest.approx(beta)
    step = Nesterov(momentum=beta)
    np.testing.assert_allclose(allocation_shares(step.noise_log_weights(2)), [0.491221, 0.508779], atol=1e-6)
    np.testing.assert_allclose(
        allocation_shares(step.noise_log_weights(3)), [0.321698, 0.333196, 0.345106], atol=1e-6
    )
    shares = allocation_shares(step.noise_log_weights(10))
    assert shares[0] == pytest.approx(0.084949, abs=1e-6)
    assert shares[-1] == pytest.approx(0.116528, abs=1e-6)
    for q in (1.0, 0.01):
        sigmas = laplace_schedule(shares, 1.0, q)
        assert np.all(np.diff(shares) > 0)
        assert np.all(np.diff(sigmas) < 0)
    full = laplace_schedule(shares, 1.0, 1.0)
    assert full[0] / full[-1] == pytest.approx(0.9**-3, rel=1e-9)


# -- §6.5–6.6, §6.9: the MASG plan, its sawtooth and the restart ----------------------------------------
def test_masg_plan():
    assert masg_stage_lengths(20, 14 + 40 + 80 + 160 + 320) == [14, 40, 80, 160, 320]
    assert [sum(masg_stage_lengths(20, 10**6, n1=13)[:k]) for k in (2, 3, 4, 5)] == [53, 133, 293, 613]
    step = MultiStageNesterov(lr=0.05, mu=1.0, L=20.0)
    np.testing.assert_allclose(step.stage_lr(np.array([1, 2, 3])), [0.05, 0.003125, 0.00078125])
    betas = [nag_momentum(float(a), 1.0) for a in step.stage_lr(np.array([1, 2, 3]))]
    np.testing.assert_allclose(betas, [0.634512, 0.894116, 0.945618], atol=1e-6)
    kappa = 255.14
    assert masg_stage_lengths(kappa, 1000)[:3] == [89, 136, 272]
    assert masg_stage_lengths(kappa, 1000)[-1] == 503


def test_masg_sawtooth_noise():
    step = MultiStageNesterov(lr=0.05, mu=1.0, L=20.0, n1=13)
    shares = allocation_shares(step.noise_log_weights(53))
    scaled = 1 / shares  # b_k · nε/S1 in full batch
    np.testing.assert_allclose(scaled[[0, 12, 13, 52]], [65.291, 23.723, 91.229, 43.187], atol=2e-3)
    np.testing.assert_allclose(shares[[0, 12, 13, 52]], [0.01532, 0.04215, 0.01096, 0.02315], atol=1e-5)
    assert int(np.argmin(scaled)) == 12
    assert int(np.argmax(scaled)) == 13
    assert np.all(np.diff(scaled[:13]) < 0)
    assert np.all(np.diff(scaled[13:]) < 0)


def _run(step, grads, x0: float, lr: float):
    p = torch.nn.Parameter(torch.tensor([x0]))
    opt = torch.optim.SGD([p], lr=lr)
    points = []
    for k, g in enumerate(grads):
        p.grad = torch.tensor([g(float(p)) if callable(g) else g])
        step.step(opt, _ctx(k))
        points.append(float(p.detach()))
    return p, opt, points


def test_masg_restart_sets_lookahead_to_iterate():
    step = MultiStageNesterov(lr=0.05, mu=1.0, L=20.0, n1=3)
    p, _, _ = _run(step, [1.0, -2.0, 3.0], x0=1.0, lr=0.05)  # the third step ends stage 1
    assert step.buffers[0] is not None
    assert float(p.detach()) == float(step.buffers[0][0])
    p2, _, _ = _run(MultiStageNesterov(lr=0.05, mu=1.0, L=20.0, n1=3), [1.0, -2.0], x0=1.0, lr=0.05)
    assert float(p2.detach()) != float(step.buffers[0][0])  # inside a stage the look-ahead differs


# -- §6.7–6.8: the forms of DP-SHB and DP-NAG agree -----------------------------------------------------
def test_heavy_ball_matches_hb_and_ema_forms():
    _, _, xs = _run(HeavyBall(beta=0.5, step_size="paper"), [1.0, 2.0], x0=0.0, lr=0.1)
    np.testing.assert_allclose(xs, [-0.1, -0.35])
    _, _, plain = _run(HeavyBall(beta=0.0), [1.0, 2.0], x0=0.0, lr=0.1)
    np.testing.assert_allclose(plain, [-0.1, -0.3])  # β = 0: DP-SGD
    # EMA form ū_t = βū + (1−β)g̃ with step α/(1−β) gives the same x_1 = −0.1; torch's SGD(dampening=β)
    # starts its buffer at g̃ instead of (1−β)g̃ and overshoots (x_1 = −0.2), the pitfall of spec §2.2.
    damp = torch.nn.Parameter(torch.tensor([0.0]))
    sgd = torch.optim.SGD([damp], lr=0.2, momentum=0.5, dampening=0.5)
    damp.grad = torch.tensor([1.0])
    sgd.step()
    assert float(damp.detach()) == pytest.approx(-0.2)
    assert xs[0] != pytest.approx(float(damp.detach()))


def test_nesterov_forms_and_finalize():
    step = Nesterov(momentum=0.5, step_size="paper")
    p, opt, zs = _run(step, [lambda x: x] * 3, x0=1.0, lr=0.1)
    np.testing.assert_allclose(zs[:2], [0.85, 0.6975])
    ref = torch.nn.Parameter(torch.tensor([1.0]))
    sgd = torch.optim.SGD([ref], lr=0.1, momentum=0.5, nesterov=True)
    for _ in range(3):
        ref.grad = ref.detach().clone()
        sgd.step()
    assert float(ref) == pytest.approx(zs[-1], rel=1e-6)  # SGD(nesterov=True) params are the z_t
    step.finalize(opt)
    assert float(p.detach()) == pytest.approx(0.62775, rel=1e-6)


# -- §6.10: budget conservation; §6.11–6.12: the Gaussian schedule; §6.13: Laplace scale ----------------
@settings(max_examples=25, deadline=None)
@given(
    log_a=st.lists(st.floats(-30, 30), min_size=1, max_size=400),
    q=st.sampled_from([1.0, 0.01, 0.3]),
    eps=st.floats(0.05, 8.0),
)
def test_paper_shares_sum_to_epsilon(log_a, q, eps):
    sigmas = laplace_schedule(allocation_shares(np.array(log_a)), eps, q)
    ledger = PrivacyLedger(1e-5, "pure")
    for s in sigmas:
        ledger.record(SubsampledLaplace(float(s), q))
    assert abs(ledger.epsilon() - eps) < 1e-9
    assert ledger.epsilon() <= eps


def test_gaussian_schedule_meets_target_from_below():
    shape = np.array([1.054093, 1.026690, 1.0])  # the NAG (q = 0.9, T = 3) ratios of §6.11
    step = Nesterov(momentum=0.9 / 1.1)
    ratios = allocation_shares(step.noise_log_weights(3), 0.25)
    np.testing.assert_allclose(ratios.max() / ratios, shape, atol=1e-6)
    sigmas = gaussian_schedule(shape, 2.0, 1e-5, 1.0)
    ledger = PrivacyLedger(1e-5)
    for s in sigmas:
        ledger.record(PoissonGaussian(float(s), 1.0))
    assert 2.0 * (1 - 1e-3) < ledger.epsilon() <= 2.0
    sub = gaussian_schedule(shape, 2.0, 1e-5, 0.1)  # Poisson q < 1: no closed form, priced by the ledger
    ledger = PrivacyLedger(1e-5)
    for s in sub:
        ledger.record(PoissonGaussian(float(s), 0.1))
    assert 2.0 * (1 - 1e-3) < ledger.epsilon() <= 2.0
    np.testing.assert_allclose(sub / sub[-1], shape, rtol=1e-9)
    # q = 1: ε(δ) depends only on Σ 1/z²; σ = (1, 2) equals two steps of σ_eq = 1.2649111.
    a, b = PrivacyLedger(1e-5), PrivacyLedger(1e-5)
    a.record(PoissonGaussian(1.0, 1.0))
    a.record(PoissonGaussian(2.0, 1.0))
    b.record(PoissonGaussian(1.2649111, 1.0), 2)
    assert a.epsilon() == pytest.approx(b.epsilon(), rel=1e-6)


def test_laplace_noise_has_scale_not_std():
    b = 0.7
    draws = laplace_noise((400_000,), b, torch.Generator().manual_seed(0), dtype=torch.float64)
    assert float(draws.var()) == pytest.approx(2 * b * b, rel=0.02)  # the authors' laprnd would give b²
    assert float(draws.abs().mean()) == pytest.approx(b, rel=0.01)  # E|X| = scale


# -- the pure accountant: basic composition, and no mixing with RDP events ------------------------------
def test_pure_ledger_prices_only_pure_events():
    ledger = PrivacyLedger(1e-5, "pure")
    ledger.record(SubsampledLaplace(1.0, 0.01), 3)
    ledger.record(SubsampledLaplace(2.0, 1.0))
    assert ledger.epsilon() == pytest.approx(3 * 0.0170369 + 0.5, abs=1e-6)
    assert ledger.affordable_count(SubsampledLaplace(2.0, 1.0), 1.0) == math.floor(
        (1 - ledger.epsilon()) / 0.5
    )
    with pytest.raises(ValueError, match="pure accountant"):
        ledger.record(PoissonGaussian(1.0, 0.01))
    with pytest.raises(ValueError, match="accountant='pure'"):
        PrivacyLedger(1e-5).record(SubsampledLaplace(1.0, 0.01))
    restored = PrivacyLedger(1e-5, "pure")
    restored.load_state_dict(ledger.state_dict())
    assert restored.epsilon() == ledger.epsilon()
    assert laplace_multiplier(subsampled_laplace_epsilon(0.3, 0.05), 0.05) == pytest.approx(0.3, rel=1e-12)


def test_noise_dividing_refuses_a_step_without_weights():
    from lightning_dp.core.errors import DPConfigurationError

    noise = NoiseDividing()
    noise.link_step(HeavyBall(beta=0.5))
    with pytest.raises(DPConfigurationError, match="momentum"):
        noise.log_weights(10)
    assert np.all(NoiseDividing(uniform=True).log_weights(4) == 0)
