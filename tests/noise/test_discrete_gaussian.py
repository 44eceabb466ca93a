"""Secure noise, without a Trainer (issue #50): the discrete Gaussian sampler against its exact pmf, its
running time, a floating-point attack that reads the float path and fails on the secure one, the integer
grid's sensitivity bound, and the ledger's bound for the discrete Gaussian.

The sampler draws from ``os.urandom``, so its tests are statistical: each is a test at level α = 1e-4.
"""

from __future__ import annotations

import math
import statistics
import time

import numpy as np
import pytest
import torch
from scipy import stats

from lightning_dp.accounting import PrivacyLedger, calibrate_noise
from lightning_dp.accounting.amplification import amplify_general, gaussian_rdp_sgm, removal_gap
from lightning_dp.accounting.discrete_gaussian import PoissonDiscreteGaussian, distributed_tau
from lightning_dp.clipping.integer_grid import GridClipping
from lightning_dp.noise import discrete_gaussian as dg
from lightning_dp.noise.discrete_gaussian import CKSSampler, DiscreteGaussian
from lightning_dp.per_example import PerExampleGradients
from lightning_dp.slots import Noise, StepContext

ALPHA = 1e-4
Z_ALPHA = float(stats.norm.isf(ALPHA / 2))  # two-sided


def exact_pmf(sigma: float) -> tuple[np.ndarray, np.ndarray]:
    """The discrete Gaussian N_Z(0, σ²) on |x| ≤ 14σ (the rest is below 1e-40), normalised."""
    span = math.ceil(14 * sigma) + 2
    x = np.arange(-span, span + 1)
    weights = np.exp(-(x.astype(np.float64) ** 2) / (2 * sigma * sigma))
    return x, weights / weights.sum()


# -- the sampler's distribution ---------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[0.8, 6.5, 1500.25], ids=lambda s: f"sigma={s}")
def draws(request) -> tuple[float, np.ndarray]:
    sigma = request.param
    return sigma, CKSSampler(sigma).sample(150_000).numpy()


def test_chi_square_against_the_exact_pmf(draws):
    sigma, values = draws
    x, pmf = exact_pmf(sigma)
    cdf = np.cumsum(pmf)
    # bins of about equal probability (at most 60), merged so every expected count is at least 20
    edges = np.unique(np.searchsorted(cdf, np.linspace(0, 1, 61)[1:-1]))
    groups = np.searchsorted(edges, np.arange(len(x)), side="left")
    expected = np.bincount(groups, weights=pmf) * len(values)
    observed = np.bincount(np.searchsorted(edges, values - x[0], side="left"), minlength=len(expected))
    assert expected.min() >= 20
    assert observed.sum() == len(values)
    p = stats.chisquare(observed, expected).pvalue
    assert p > ALPHA, f"σ={sigma}: χ² p-value {p:.2e} over {len(expected)} bins"


def test_tails_and_variance_match_the_exact_pmf(draws):
    sigma, values = draws
    x, pmf = exact_pmf(sigma)
    n = len(values)
    for k in (2.0, 3.0, 3.5):  # P[|Y| ≥ kσ]: two-sided binomial tests
        p = float(pmf[np.abs(x) >= k * sigma].sum())
        count = int((np.abs(values) >= k * sigma).sum())
        assert stats.binomtest(count, n, p).pvalue > ALPHA, (
            f"σ={sigma}: P[|Y| ≥ {k}σ] {count / n:.3e} vs {p:.3e}"
        )
    second, fourth = float((pmf * x**2.0).sum()), float((pmf * x**4.0).sum())
    z_var = (float(np.mean(values.astype(np.float64) ** 2)) - second) / math.sqrt((fourth - second**2) / n)
    z_mean = float(np.mean(values)) / math.sqrt(second / n)
    assert abs(z_var) < Z_ALPHA, z_var
    assert abs(z_mean) < Z_ALPHA, z_mean


def test_its_error_bounds_are_what_the_ledger_is_told():
    for sigma in (0.5, 3.0, 1e3, 2.0**40):
        sampler = CKSSampler(sigma)
        assert sampler.t >= sigma
        assert (sampler.t & (sampler.t - 1)) == 0
        assert 0.3 < sampler.acceptance < 0.5
        assert sampler.relative_error < 3e-13
        assert sampler.tail < 1e-14
    with pytest.raises(ValueError):
        CKSSampler(0.4)


@pytest.mark.parametrize("sigma", [0.8, 3.0, 12.0])
def test_the_tail_bound_covers_the_exact_tail_and_counts_the_whole_bulk(sigma):
    """β bounds the exact pmf's mass beyond the bulk (σ²/t + 10σ) three times over, and is no looser than the
    erfc bound at that edge (an edge left at 10σ overstated it by a factor of 10² to 10⁴)."""
    sampler = CKSSampler(sigma)
    edge = sampler.shift + math.sqrt(2 * dg.BULK_EXPONENT) * sigma
    z = np.arange(-int(edge) - 400, int(edge) + 401, dtype=np.float64)
    logs = -(z**2) / (2 * sigma**2)
    pmf = np.exp(logs - logs.max())
    pmf /= pmf.sum()
    exact = float(pmf[np.abs(z) > edge].sum())
    assert exact <= (sampler.tail - 2.0**-120) / 3
    assert sampler.tail <= 3 * math.erfc((edge - 1) / (sigma * math.sqrt(2))) + 2.0**-119


# -- the timing channel -----------------------------------------------------------------------------------------


def test_every_call_draws_the_same_random_words_whatever_it_returns(monkeypatch):
    """The work of a call is fixed by how many values it draws (and σ), never by the values: each call
    asks the CSPRNG for 4 words per candidate, the Hoeffding count for its size."""
    asked: list[int] = []
    real = dg.secure_words

    def counting(count: int, device="cpu"):
        asked.append(count)
        return real(count, device)

    monkeypatch.setattr(dg, "secure_words", counting)
    sampler = CKSSampler(40.0)
    maxima = []
    for _ in range(60):
        asked.clear()
        maxima.append(int(sampler.sample(32).abs().max()))
        assert asked == [4 * sampler.candidates(32)]
    assert max(maxima) > 2 * min(maxima)  # large and small draws did happen, at the same cost


def _timed(draw, calls: int) -> tuple[list[float], list[float]]:
    times, sizes = [], []
    for _ in range(calls):
        start = time.perf_counter_ns()
        value = draw()
        times.append(time.perf_counter_ns() - start)
        sizes.append(value)
    return times, sizes


def _large_vs_small(times: list[float], sizes: list[float]) -> float:
    """Mann–Whitney p-value between the times of the calls that drew values above and below the median
    (robust to the scheduler's occasional long pauses, which a mean would follow)."""
    median = statistics.median(sizes)
    large = [t for t, v in zip(times, sizes, strict=True) if v > median]
    small = [t for t, v in zip(times, sizes, strict=True) if v < median]
    return float(stats.mannwhitneyu(large, small).pvalue)


def _walk_sampler(sigma: float, rng: np.random.Generator) -> int:
    """The textbook inverse-CDF discrete Gaussian: walk out from 0 until the mass passes a uniform. Exact in
    distribution, and its loop runs |y| times: its running time is the value (what Jin et al. 2022 timed)."""
    u, x = rng.random(), 0
    mass = 1 / (sigma * math.sqrt(2 * math.pi))
    while u > mass:
        x += 1
        mass += 2 * math.exp(-x * x / (2 * sigma * sigma)) / (sigma * math.sqrt(2 * math.pi))
    return x


def test_the_time_of_a_draw_does_not_depend_on_its_value():
    """Jin et al. 2022 timed samplers whose loops run longer for larger values. The same measurement finds
    that channel in an inverse-CDF walk; on the vectorised sampler large and small draws take the same time
    (α = 1e-4)."""
    sampler = CKSSampler(20.0)
    sampler.sample(1)  # warm-up
    times, sizes = _timed(lambda: abs(int(sampler.sample(1)[0])), 600)
    assert _large_vs_small(times, sizes) > ALPHA
    rng = np.random.default_rng()
    walk_times, walk_sizes = _timed(lambda: _walk_sampler(20.0, rng), 600)
    assert _large_vs_small(walk_times, walk_sizes) < ALPHA  # the measurement does see a timing channel


# -- the floating-point attack ----------------------------------------------------------------------------------


class _FloatNoise(Noise):
    """The float path's draw (``Noise.add_noise``: fp32 ``torch.randn`` scaled and added in place)."""

    def noise_multiplier(self, step: int) -> float:
        return 1.0

    def calibrate(self, *args) -> None:
        del args


def _box_muller_residue(released: torch.Tensor, candidate: torch.Tensor, std: float) -> float:
    """How far the noise that ``candidate`` implies is from CPU ``torch.randn``'s lattice: in each block of 16
    it is Box–Muller on pairs (j, j + 8) of 24-bit uniforms, so inverting a pair gives u₁, u₂ near multiples
    of 2⁻²⁴ for the true sum and anywhere for a wrong one. Mean distance to the nearest multiple, in units."""
    z = ((released - candidate) / std).view(-1, 2, 8)
    a, b = z[:, 0, :], z[:, 1, :]
    u2 = (torch.atan2(b, a) / (2 * math.pi)) % 1
    u1 = 1 - torch.exp(-(a * a + b * b) / 2)
    k = torch.cat([u1.flatten(), u2.flatten()]) * 2**24
    return float((k - k.round()).abs().mean())


def _neighbours(d: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The attacker's two candidate clipped sums: D's (norm 3C) and D′'s, one example (norm C) more."""
    s = torch.randn(d, generator=generator, dtype=torch.float64)
    x = torch.randn(d, generator=generator, dtype=torch.float64)
    return s * (3 / s.norm()), x / x.norm()


def test_a_floating_point_attack_reads_the_float_path_and_fails_on_the_secure_one():
    """The attacker knows both candidate sums and checks which one the released values could come from.

    One release at σ = 4 (q = 1): no test can tell D from D′ with probability above Φ(1/(2σ)) = 0.55. On the
    float path the lattice of fp32 Box–Muller tells them apart every time; on the secure path every integer
    is a possible output of either candidate, and the same test is a coin flip."""
    d, sigma, trials = 4096, 4.0, 40
    bound = float(stats.norm.cdf(1 / (2 * sigma)))
    generator = torch.Generator().manual_seed(7)
    secure = DiscreteGaussian(sigma, rounding_slack=1e-3)
    clipping = GridClipping(secure.grid)
    clipping.setup([torch.zeros(d)])
    float_wins = secure_wins = 0
    for trial in range(trials):
        s, x = _neighbours(d, generator)
        truth = trial % 2
        released = _FloatNoise().add_noise([(s + truth * x).float()], sigma, torch.Generator())[0].double()
        guess = _box_muller_residue(released, s + x, sigma) < _box_muller_residue(released, s, sigma)
        float_wins += int(guess == bool(truth))
        # the secure path: the same sums as per-example gradients, rounded, summed in int64, discrete noise
        rows = torch.stack([s, x]).float()[: 1 + truth]
        ctx = StepContext(0, len(rows), 1.0, 10.0, sigma, torch.Generator())
        integers = clipping.clip_and_sum(PerExampleGradients.from_tensors([rows]), ctx)
        candidates = [
            clipping.clip_and_sum(PerExampleGradients.from_tensors([r]), ctx)[0].double()
            for r in (rows[:1], torch.stack([s, x]).float())
        ]
        noisy = secure.add_noise(integers, sigma * clipping.sensitivity(ctx), torch.Generator())[0].double()
        assert all(bool(torch.equal(noisy - c, (noisy - c).round())) for c in candidates)  # both reachable
        std = sigma * clipping.sensitivity(ctx)
        guess = _box_muller_residue(noisy, candidates[1], std) < _box_muller_residue(
            noisy, candidates[0], std
        )
        secure_wins += int(guess == bool(truth))
    slack = Z_ALPHA * math.sqrt(0.25 / trials)
    assert float_wins / trials >= max(0.95, bound + slack), float_wins
    assert secure_wins / trials < bound + slack, secure_wins


# -- the integer grid -------------------------------------------------------------------------------------------


def _ctx(batch: int, C: float) -> StepContext:
    return StepContext(0, batch, float(batch), C, 1.0, torch.Generator())


@pytest.mark.parametrize("slack", [1e-1, 1e-3])
def test_every_rounded_contribution_is_within_the_sensitivity(slack):
    g = torch.Generator().manual_seed(0)
    grads = [100 * torch.randn(16, 5, 7, generator=g), torch.randn(16, 7, generator=g) * 1e-3]
    clipping = GridClipping(DiscreteGaussian(1.0, rounding_slack=slack).grid)
    clipping.setup([p[0] for p in grads])
    for C in (1e-3, 0.5, 40.0):
        for i in range(16):
            one = clipping.clip_and_sum(
                PerExampleGradients.from_tensors([p[i : i + 1] for p in grads]), _ctx(1, C)
            )
            norm = math.sqrt(sum(float(t.double().square().sum()) for t in one))
            assert norm <= clipping.sensitivity(_ctx(1, C))
            assert clipping.grid.step(C) * clipping.sensitivity(_ctx(1, C)) <= C * (1 + slack + 1.01e-4)


def test_the_integer_sum_is_flat_clipping_up_to_half_a_grid_step_per_example():
    """The neutral check: the released sum (σ = 0) is DP-SGD's clipped sum, up to the rounding (≤ γ/2 a
    coordinate and example), and it is exact: the same integers in any order or split."""
    from lightning_dp import FlatClipping

    g = torch.Generator().manual_seed(1)
    grads = [3 * torch.randn(8, 4, 3, generator=g), torch.randn(8, 3, generator=g)]
    clipping = GridClipping(DiscreteGaussian(0.0).grid)
    clipping.setup([p[0] for p in grads])
    ctx = _ctx(8, 1.0)
    integers = clipping.clip_and_sum(PerExampleGradients.from_tensors(grads), ctx)
    released = clipping.finalize([s.clone() for s in integers], ctx)
    flat = [s / 8 for s in FlatClipping().clip_and_sum(PerExampleGradients.from_tensors(grads), ctx)]
    step = clipping.grid.step(1.0)
    for a, b in zip(released, flat, strict=True):
        assert float((a - b).abs().max()) <= step / 2 + 2e-5  # 2e-5: FlatClipping's own 1e-5 inflation
    split = [
        a + b
        for a, b in zip(
            clipping.clip_and_sum(PerExampleGradients.from_tensors([p[:3] for p in grads]), ctx),
            clipping.clip_and_sum(PerExampleGradients.from_tensors([p[3:] for p in grads]), ctx),
            strict=True,
        )
    ]
    assert all(torch.equal(a, b) for a, b in zip(integers, split, strict=True))


def test_the_integer_sum_is_exact_beyond_two_to_the_53():
    """Rounded rows of about 2⁴⁶ grid units, 2048 of them: their sum passes 2⁵³, where fp64 adds inexactly;
    the integers must still add up exactly (each chunk exactly, the chunks in int64), whatever the order."""
    from lightning_dp.clipping import integer_grid

    g = torch.Generator().manual_seed(3)
    unit = 2.0**46
    rows = torch.randint(-(2**20), 2**20, (2048, 4), generator=g, dtype=torch.int64) + (2**46 - 2**21)
    values = rows.to(torch.float64)
    total, _ = integer_grid._round_and_sum(
        values, torch.ones(2048, dtype=torch.float64), torch.float64, unit, again=False, clean=True
    )
    exact = [sum(int(v) for v in rows[:, j].tolist()) for j in range(4)]
    assert total.tolist() == exact
    flipped, _ = integer_grid._round_and_sum(
        values.flip(0), torch.ones(2048, dtype=torch.float64), torch.float64, unit, again=False, clean=True
    )
    assert torch.equal(total, flipped)


def test_non_finite_examples_are_dropped_and_sums_never_overflow():
    grads = [torch.randn(4, 6)]
    grads[0][1, 2] = math.nan
    grads[0][2, 0] = math.inf
    noise = DiscreteGaussian(1.0)
    clipping = GridClipping(noise.grid)
    clipping.setup([grads[0][0]])
    sums = clipping.clip_and_sum(PerExampleGradients.from_tensors(grads), _ctx(4, 1.0))
    alone = clipping.clip_and_sum(PerExampleGradients.from_tensors([grads[0][[0, 3]]]), _ctx(2, 1.0))
    assert torch.equal(sums[0], alone[0])
    tiny = DiscreteGaussian(1.0, rounding_slack=1e-19)  # a grid so fine that 4 examples could overflow int64

    class Data:
        num_samples = 4

    tiny.link_sampler(Data())  # type: ignore[arg-type]
    tiny.setup([torch.zeros(6)])
    from lightning_dp import DPConfigurationError

    with pytest.raises(DPConfigurationError, match="overflow int64"):
        tiny.add_noise([torch.zeros(6, dtype=torch.int64)], 1.0, torch.Generator())
    with pytest.raises(DPConfigurationError, match="integer sums only"):
        noise.add_noise([torch.zeros(6)], 1.0, torch.Generator())


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
