"""The ledger's bound for the discrete Gaussian (``accounting/discrete_gaussian.py``, issue #50): the sampled
Gaussian's RDP at integer orders on one rank, removal no dearer than addition, the distributed bound over ranks,
and the sampler's error in the RDP."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_dp.accounting import PrivacyLedger, calibrate_noise
from lightning_dp.accounting.amplification import amplify_general, gaussian_rdp_sgm, removal_gap
from lightning_dp.accounting.discrete_gaussian import PoissonDiscreteGaussian, distributed_tau
from lightning_dp.noise.discrete_gaussian import DiscreteGaussian
from tests.noise.test_discrete_gaussian import exact_pmf

# -- the ledger's bound -----------------------------------------------------------------------------------------


def test_one_rank_without_sampler_error_is_the_sampled_gaussian_at_integer_orders():
    orders = (2.0, 3.0, 8.0, 32.0, 256.0)
    for sigma, q in ((0.8, 0.01), (2.2, 0.09), (5.0, 0.5), (1.0, 1.0)):
        event = PoissonDiscreteGaussian(sigma, q, 1, 10, 1e4, 0.0)
        np.testing.assert_allclose(
            event.rdp(orders), gaussian_rdp_sgm(orders, 1 / (2 * sigma**2), q), rtol=1e-9
        )
        assert np.isinf(event.rdp((1.5,))).all()  # fractional orders: no bound claimed
    # the price at the figures: within 1 % of DP-SGD's σ (the ledger's float path) at the same ε
    for q, steps in ((128 / 1437, 225), (512 / 60000, 351)):
        noise = DiscreteGaussian(rounding_slack=1e-3)
        noise.grid.dimension = 26_010

        class Sampled:
            sample_rate = q

        noise.calibrate(3.0, 1e-5, Sampled(), steps, "rdp")  # type: ignore[arg-type]
        assert noise.sigma is not None
        ledger = PrivacyLedger(1e-5)
        ledger.record(noise.step_event(0, Sampled(), noise.sigma), steps)  # type: ignore[arg-type]
        assert ledger.epsilon() <= 3.0
        dp_sgd = calibrate_noise(target_epsilon=3.0, delta=1e-5, sample_rate=q, steps=steps)
        assert noise.sigma < 1.02 * dp_sgd


def test_removing_costs_no_more_than_adding_for_symmetric_noise():
    """The step that removes the factor 3: F(L) ≥ 0 (proved in its docstring), checked on a wide grid, and
    both directions of a Poisson-subsampled 1-D discrete Gaussian computed by direct summation stay below
    the event's bound."""
    L = np.exp(np.linspace(-40, 40, 40_001))
    for alpha in (1.5, 2.0, 7.0, 64.0):
        for q in (1e-3, 0.1, 0.5, 0.99):
            assert removal_gap(L, q, alpha).min() >= -1e-12 * np.abs(removal_gap(L, q, alpha)).max()
    sigma, shift, q = 2.0, 3, 0.3  # σ in units of the shift Δ = 3: N_Z(0, 36)
    x, p = exact_pmf(sigma * shift)
    r = np.interp(x - shift, x, p, left=0, right=0)
    mix = (1 - q) * p + q * r
    bound = PoissonDiscreteGaussian(sigma, q, 1, 1, sigma * shift, 0.0)
    from scipy.special import logsumexp

    for alpha in (2, 3, 6, 12):
        add = float(logsumexp(alpha * np.log(mix) + (1 - alpha) * np.log(p))) / (alpha - 1)
        remove = float(logsumexp(alpha * np.log(p) + (1 - alpha) * np.log(mix))) / (alpha - 1)
        assert remove <= add <= float(bound.rdp((float(alpha),))[0]) * (1 + 1e-9)


def test_shares_of_several_ranks_are_priced_by_the_distributed_bound():
    """Kairouz et al. 2021: W shares of N_Z(0, σ₀²) sum to ½ε²-CDP with ε = Δ/(√W σ₀) + τ√d."""
    assert distributed_tau(0.6, 1) == 0.0
    assert distributed_tau(0.6, 4) == pytest.approx(
        10 * sum(math.exp(-2 * math.pi**2 * 0.36 * k / (k + 1)) for k in (1, 2, 3))
    )
    tight = PoissonDiscreteGaussian(1.0, 0.1, 4, 1000, 0.6, 0.0)
    wide = PoissonDiscreteGaussian(1.0, 0.1, 4, 1000, 50.0, 0.0)
    assert tight.concentrated_epsilon() > wide.concentrated_epsilon() == pytest.approx(1.0)
    noise = DiscreteGaussian(2.0)
    noise.grid.dimension = 100
    noise.link_ranks(4)
    assert noise.share_scale(2.0) == pytest.approx(2.0 * noise.grid.sensitivity / 2)
    shares = [
        noise.add_noise([torch.zeros(20_000, dtype=torch.int64)], noise.share_scale(2.0), torch.Generator())[
            0
        ]
        for _ in range(4)
    ]
    total = torch.stack(shares).sum(0).double()
    assert float(total.var()) == pytest.approx((2.0 * noise.grid.sensitivity) ** 2, rel=0.05)


def test_the_sampler_error_enters_the_rdp_and_the_event_survives_a_checkpoint():
    plain = PoissonDiscreteGaussian(1.0, 0.05, 1, 10**6, 1e5, 0.0)
    drifted = PoissonDiscreteGaussian(1.0, 0.05, 1, 10**6, 1e5, 2e-13)
    orders = (2.0, 16.0)
    assert (drifted.rdp(orders) > plain.rdp(orders)).all()
    assert drifted.rdp(orders)[0] - plain.rdp(orders)[0] < 1e-6
    restored = PoissonDiscreteGaussian.from_dict(drifted.to_dict())
    assert restored == drifted
    general = amplify_general((8.0,), lambda a: a * 0.5, 0.1)[0]  # Zhu & Wang's factor 3 on the terms l ≥ 3
    assert general > amplify_general((8.0,), lambda a: a * 0.5, 0.1, symmetric=True)[0]
