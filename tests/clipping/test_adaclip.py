"""AdaCliP: the spec's unit-testable properties (shared/specs/adaclip.md §6) and its place in the strategy."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import TinyModule, make_trainer

from lightning_dp import AdaCliP, DPStrategy, FlatClipping, StepContext
from lightning_dp.accounting import compute_epsilon
from lightning_dp.clipping import adaclip_scale
from lightning_dp.per_example import PerExampleGradients


def ctx(batch: float, z: float = 0.0) -> StepContext:
    return StepContext(
        step=0, batch_size=int(batch), expected_batch_size=batch, max_grad_norm=1.0, noise_multiplier=z,
        generator=torch.Generator(),
    )  # fmt: skip


def with_state(m: list[float], s: list[float], **kwargs) -> AdaCliP:
    clip = AdaCliP(h2=kwargs.pop("h2", 1e4), **kwargs)
    clip.setup([torch.zeros(len(m))])
    clip.m, clip.s = [torch.tensor(m)], [torch.tensor(s)]
    return clip


def close(t: torch.Tensor, values: list[float], tol: float = 1e-5) -> None:
    torch.testing.assert_close(t, torch.tensor(values), rtol=tol, atol=tol)


def test_b_formula_and_homogeneity():
    b = adaclip_scale([torch.tensor([1.0, 4.0, 4.0])])[0]
    close(b, [3.0, 6.0, 6.0])
    close(adaclip_scale([torch.tensor([1.0, 4.0, 4.0])], gamma=4.0)[0], [1.5, 3.0, 3.0])
    close(adaclip_scale([torch.tensor([10.0, 40.0, 40.0])])[0], [30.0, 60.0, 60.0])
    s = torch.rand(7) + 0.1
    bs = adaclip_scale([s[:3], s[3:]], gamma=2.5)
    assert float(
        sum((si.square() / bi.square()).sum() for si, bi in zip((s[:3], s[3:]), bs, strict=True))
    ) == (pytest.approx(2.5))


def test_uniform_s_gives_uniform_b_and_paper_init():
    close(adaclip_scale([torch.full((5,), 2.0)])[0], [2.0 * math.sqrt(5)] * 5)
    clip = AdaCliP(h2=1e-2)
    clip.setup([torch.zeros(7850)])
    assert float(adaclip_scale(clip.s)[0][0]) == pytest.approx(8.860e-6, rel=1e-3)


def test_reduces_to_dp_sgd_at_a_zero_b_c():
    C = 2.0
    clip = with_state([0.0, 0.0], [C / math.sqrt(2)] * 2)
    g = torch.tensor([[3.0, 4.0], [0.6, 0.8]])
    sums = clip.clip_and_sum(PerExampleGradients.from_tensors([g]), ctx(2))
    close(clip.finalize(sums, ctx(2))[0], [0.9, 1.2])
    flat = FlatClipping()
    flat_ctx = ctx(2)
    flat_ctx.max_grad_norm = C
    close(
        flat.finalize(flat.clip_and_sum(PerExampleGradients.from_tensors([g]), flat_ctx), flat_ctx)[0],
        [0.9, 1.2],
    )


@pytest.mark.parametrize(
    ("mode", "s_new"),
    [("per_example", [1.060660, 4.125869, 3.853570]), ("literal", [1.006231, 3.963760, 3.824265])],
)
def test_worked_step_without_noise(mode, s_new):
    clip = with_state([1.0, 0.0, -1.0], [1.0, 4.0, 4.0], variance_mode=mode)
    g = torch.tensor([[4.0, 6.0, -1.0], [1.0, 3.0, 2.0]])
    R = clip.clip_and_sum(PerExampleGradients.from_tensors([g]), ctx(2))[0]
    close(R, [0.707107, 1.207107, 0.5])
    close(clip.finalize([R], ctx(2))[0], [2.060660, 3.621320, 0.5])
    close(clip.s[0], s_new)
    close(clip.m[0], [1.010607, 0.036213, -0.985])


def test_worked_step_with_a_fixed_noise_draw():
    clip = with_state([1.0, 0.0, -1.0], [1.0, 4.0, 4.0])
    g = torch.tensor([[4.0, 6.0, -1.0], [1.0, 3.0, 2.0]])
    R = clip.clip_and_sum(PerExampleGradients.from_tensors([g]), ctx(2, z=0.5))[0] + 0.5 * torch.tensor(
        [1.0, -2.0, 0.5]
    )
    close(R, [1.207107, 0.207107, 0.75])
    # 1e-4: clip_factors inflates norms by 1e-5 relative (the fp32 safety margin on the bound)
    close(clip.finalize([R], ctx(2, z=0.5))[0], [2.810660, 0.621320, 1.25], tol=1e-4)
    close(clip.s[0], [1.201332, 3.794733, 3.868139])
    close(clip.m[0], [1.018107, 0.006213, -0.9775])


def test_noise_covariance_is_diag_b_squared():
    """Every example at the mean: g̃ − m = b·Z/B, per-coordinate std b·z/B, uncorrelated."""
    z, B, draws = 2.0, 4, 20_000
    clip = with_state([0.5, -1.0, 2.0], [1.0, 4.0, 4.0])
    g = torch.tensor([[0.5, -1.0, 2.0]] * B)
    R = clip.clip_and_sum(PerExampleGradients.from_tensors([g]), ctx(B, z))[0]
    assert float(R.abs().max()) == 0.0
    noise = z * torch.randn(draws, 3, generator=torch.Generator().manual_seed(0))
    b = adaclip_scale(clip.s)[0]
    samples = b * noise / B
    close(samples.std(0), [1.5, 3.0, 3.0], tol=0.03 * 3)
    corr = torch.corrcoef(samples.T)
    assert float((corr - torch.eye(3)).abs().max()) < 0.03


def test_invertible_when_nothing_is_clipped():
    g = torch.randn(5, 4)
    clip = with_state([0.3, -0.2, 0.1, 0.0], [100.0] * 4)
    R = clip.clip_and_sum(PerExampleGradients.from_tensors([g]), ctx(5))
    torch.testing.assert_close(clip.finalize(R, ctx(5))[0], g.mean(0), rtol=1e-5, atol=1e-6)


def test_statistics_stay_clamped_and_finite():
    clip = AdaCliP(h2=1e-12)
    clip.setup([torch.zeros(3, 2), torch.zeros(4)])
    for step in range(30):
        g = [torch.randn(8, 3, 2) * 10, torch.randn(8, 4) * 1e-3]
        c = ctx(8, z=1.0)
        sums = clip.clip_and_sum(PerExampleGradients.from_tensors(g), c)
        sums = [s + torch.randn(s.shape) for s in sums]
        out = clip.finalize(sums, c)
        assert all(torch.isfinite(t).all() for t in out + clip.m + clip.s), step
        for s in clip.s:
            assert float(s.square().min()) >= min(clip.init_std**2, 1e-12) * (1 - 1e-5)
            assert float(s.square().max()) <= max(clip.init_std**2, 1e-12) * (1 + 1e-5)


def test_bad_hyperparameters_are_refused():
    with pytest.raises(ValueError, match="0 < h1 ≤ h2"):
        AdaCliP(h2=1e-13)
    with pytest.raises(ValueError, match="variance_mode"):
        AdaCliP(h2=1.0, variance_mode="both")  # type: ignore[arg-type]


def test_in_the_strategy_epsilon_is_exactly_dp_sgd():
    module = TinyModule(n=256, batch_size=32)
    strategy = DPStrategy(noise_multiplier=1.0, clipping=AdaCliP(h2=1e-2), seed=0)
    make_trainer(strategy, max_epochs=3).fit(module)
    assert strategy.engine.steps == 24
    assert strategy.epsilon == compute_epsilon(noise_multiplier=1.0, sample_rate=1 / 8, steps=24, delta=1e-5)
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert [e.noise_multiplier for e, _ in strategy.ledger.history] == [1.0]


def test_virtual_batching_gives_the_same_step_and_statistics():
    reference = TinyModule(n=64, batch_size=64)
    split = copy.deepcopy(reference)
    clips = []
    for module, chunk in ((reference, None), (split, 10)):
        clip = AdaCliP(h2=1.0)
        clips.append(clip)
        strategy = DPStrategy(noise_multiplier=0.7, clipping=clip, seed=2, max_physical_batch_size=chunk)
        make_trainer(strategy, max_epochs=3).fit(module)
    for a, b in zip(reference.parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(clips[0].m + clips[0].s, clips[1].m + clips[1].s, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_state_is_checkpointed_and_resumes_exactly(tmp_path):
    first = TinyModule(n=128, batch_size=32)
    straight = copy.deepcopy(first)
    trainer = make_trainer(
        DPStrategy(noise_multiplier=1.0, clipping=AdaCliP(h2=1.0), seed=4), tmp_path, max_epochs=1
    )
    trainer.fit(first)
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    saved = torch.load(tmp_path / "a.ckpt", weights_only=True)["lightning_dp"]["slots"]["clipping"]
    assert saved["name"] == "AdaCliP"
    assert len(saved["state"]["m"]) == len(list(first.parameters()))
    resumed_clip = AdaCliP(h2=1.0)
    resumed = TinyModule(n=128, batch_size=32)
    strategy = DPStrategy(noise_multiplier=1.0, clipping=resumed_clip, seed=4)
    make_trainer(strategy, tmp_path, max_epochs=2).fit(resumed, ckpt_path=tmp_path / "a.ckpt")
    straight_clip = AdaCliP(h2=1.0)
    make_trainer(DPStrategy(noise_multiplier=1.0, clipping=straight_clip, seed=4), max_epochs=2).fit(straight)
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    for a, b in zip(straight_clip.s, resumed_clip.s, strict=True):
        torch.testing.assert_close(a, b)


# -- the remaining spec properties (§6: 2, 4 with noise, 9, 10, 11, 13, 14, 17) -----------------------------


def test_noise_energy_beats_whitening_and_uniform_clipping():
    """Property 2: at E‖w‖² = γ, ‖b‖² = (Σ s)² = 81 vs d·Σ s² = 99 for whitening or a uniform clip."""
    s = torch.tensor([1.0, 4.0, 4.0])
    assert float(adaclip_scale([s])[0].square().sum()) == pytest.approx(81.0)
    whitening = math.sqrt(3) * s  # b_i ∝ s_i with Σ s²/b² = 1
    uniform = torch.full((3,), math.sqrt(float(s.square().sum())))  # b = C with Σ s²/C² = 1
    assert float(whitening.square().sum()) == pytest.approx(99.0)
    assert float(uniform.square().sum()) == pytest.approx(99.0)
    equal = torch.full((3,), 2.0)
    assert float(adaclip_scale([equal])[0].square().sum()) == pytest.approx(36.0)
    assert float((math.sqrt(3) * equal).square().sum()) == pytest.approx(36.0)


def test_first_step_with_noise_is_dp_sgd_in_the_strategy():
    """Property 4 with z > 0: m = 0 and s = C/√d make b = C, so one AdaCliP step is DP-SGD's step
    (same seed, same Poisson batch, same noise draw)."""
    C, z = 0.5, 1.3
    reference = TinyModule(n=128, batch_size=32)
    dpsgd = copy.deepcopy(reference)
    d = sum(p.numel() for p in reference.parameters())
    adaclip = DPStrategy(noise_multiplier=z, clipping=AdaCliP(h2=1.0, init_std=C / math.sqrt(d)), seed=7)
    make_trainer(adaclip, max_steps=1).fit(reference)
    make_trainer(DPStrategy(noise_multiplier=z, max_grad_norm=C, seed=7), max_steps=1).fit(dpsgd)
    for a, b in zip(reference.parameters(), dpsgd.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_error_decomposition_for_one_example():
    """Property 9 (B = 1): E‖g̃ − g‖² = ‖g − a‖²(1 − 1/‖w‖)² + z²‖b‖² = 3.8604 + 20.25 = 24.1104."""
    clip = with_state([0.0, 0.0, 0.0], [1.0, 4.0, 4.0])  # b = [3, 6, 6]
    g = torch.tensor([[3.0, 6.0, 0.0]])
    R = clip.clip_and_sum(PerExampleGradients.from_tensors([g]), ctx(1, z=0.5))[0]
    draws = 0.5 * torch.randn(40_000, 3, generator=torch.Generator().manual_seed(1))
    g_tilde = adaclip_scale(clip.s)[0] * (R + draws)  # a = 0, B = 1
    assert float((g_tilde - g).square().sum(1).mean()) == pytest.approx(24.1104, rel=0.03)


@pytest.mark.parametrize("gamma", [1.0, 4.0])
def test_theorem_1_scale_attains_the_constraint(gamma):
    """Property 10: g ~ N(μ, diag(std²)), a = μ, b from std = [1, 4, 4]: E‖(g − a)/b‖² = γ."""
    std, mu = torch.tensor([1.0, 4.0, 4.0]), torch.tensor([0.5, -2.0, 1.0])
    g = mu + std * torch.randn(40_000, 3, generator=torch.Generator().manual_seed(2))
    b = adaclip_scale([std], gamma=gamma)[0]
    assert float(((g - mu) / b).square().sum(1).mean()) == pytest.approx(gamma, rel=0.03)


def test_variance_estimator_without_clipping():
    """Property 11: with no clipping, b²(R² − z²)/B² estimates Var(batch mean) and ×B the per-example
    variance; the h1 clamp's bias constant E[max(Z² − 1, 0)] = 2φ(1) = 0.483941."""
    B, z, steps = 8, 0.01, 2000
    std, mu = torch.tensor([1.0, 2.0, 0.5]), torch.tensor([1.0, -1.0, 0.0])
    gen = torch.Generator().manual_seed(3)
    clip = with_state(mu.tolist(), [20 / math.sqrt(3)] * 3)  # b = 20: E‖w‖² = 0.013, no clipping
    b = adaclip_scale(clip.s)[0]
    samples = []
    for _ in range(steps):
        g = mu + std * torch.randn(B, 3, generator=gen)
        R = clip.clip_and_sum(PerExampleGradients.from_tensors([g]), ctx(B, z))[0] + z * torch.randn(
            3, generator=gen
        )
        samples.append(b.square() * (R.square() - z * z) / B)  # per_example mode, before the clamp
    close(torch.stack(samples).mean(0), std.square().tolist(), tol=0.1)
    Z = torch.randn(400_000, generator=gen)
    assert float((Z.square() - 1).clamp(min=0).mean()) == pytest.approx(
        2 * math.exp(-0.5) / math.sqrt(2 * math.pi), rel=0.01
    )
    assert 2 * math.exp(-0.5) / math.sqrt(2 * math.pi) == pytest.approx(0.483941, abs=1e-6)


def test_epsilon_ignores_adaclip_hyperparameters_and_matches_the_anchors():
    """Property 13: the ledger prices (z, q, T) only; Opacus-RDP anchors at q = 0.01, δ = 1e-5."""
    epsilons = set()
    for clip in (AdaCliP(h2=1e-2), AdaCliP(h2=1.0, gamma=4.0, beta1=0.5, beta2=0.1)):
        strategy = DPStrategy(noise_multiplier=1.0, clipping=clip, seed=0)
        make_trainer(strategy, max_steps=5).fit(TinyModule(n=256, batch_size=32))
        epsilons.add(strategy.epsilon)
    assert len(epsilons) == 1
    anchors = {(1.0, 1000): 2.1014, (2.0, 1000): 0.6862}
    for (z, steps), eps in anchors.items():
        assert compute_epsilon(
            noise_multiplier=z, sample_rate=0.01, steps=steps, delta=1e-5
        ) == pytest.approx(eps, abs=2e-3)


def test_toy_regression_puts_noise_only_on_the_informative_coordinate():
    """Property 14: x = (±1, 0, …, 0) ⇒ std = [1, 0, …]; the optimal b is ≈ [1, 0, …] (noise energy σ²)
    where DP-SGD with C = 1 and whitening pay 10σ²."""
    std = torch.tensor([1.0] + [1e-6] * 9)  # h1-floored stds
    b = adaclip_scale([std])[0]
    assert float(b[0]) == pytest.approx(1.0, rel=1e-4)
    assert float(b[1:].max()) < 1e-2
    assert float(b.square().sum()) == pytest.approx(1.0, rel=1e-4)
    assert float(torch.ones(10).square().sum()) == 10.0  # DP-SGD, C = 1


def test_only_public_statistics_are_logged():
    """Property 17: the callback logs ε bookkeeping only, never raw per-example statistics."""
    module = TinyModule(n=128, batch_size=32)
    trainer = make_trainer(DPStrategy(noise_multiplier=1.0, clipping=AdaCliP(h2=1e-2), seed=0), max_steps=3)
    trainer.fit(module)
    dp_keys = {k for k in trainer.callback_metrics if k.startswith("dp/")}
    assert dp_keys <= {"dp/epsilon", "dp/delta", "dp/noise_multiplier", "dp/sample_rate", "dp/steps"}


# -- the fast path: transformed norms without per-example gradients --------------------------------------------


class _Mixed(torch.nn.Module):
    """Linear on vectors, Linear on sequences, an Embedding, a LayerNorm, a bias-free Linear and an unused one."""

    def __init__(self, d_in: int, hidden: int, T: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(7, hidden)
        self.seq = torch.nn.Linear(d_in, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        self.vec = torch.nn.Linear(d_in, hidden, bias=False)
        self.head = torch.nn.Linear(hidden, 3)
        self.unused = torch.nn.Linear(2, 2)
        self.T = T

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.seq(x) + self.emb(tokens)).tanh().mean(1)  # [B, T, hidden] -> [B, hidden]
        return self.head(h + self.vec(x[:, 0]))


@pytest.mark.parametrize("seed", range(4))
def test_fast_transformed_norms_equal_the_materialised_ones(seed):
    from lightning_dp.clipping.adaclip import transformed_sq_norms
    from lightning_dp.per_example import GradientCapture

    gen = torch.Generator().manual_seed(seed)
    B, d_in, hidden, T = (int(v) for v in torch.randint(2, 9, (4,), generator=gen))
    torch.manual_seed(seed)
    model = _Mixed(d_in, hidden, T)
    x, tokens = torch.randn(B, T, d_in, generator=gen), torch.randint(0, 7, (B, T), generator=gen)
    y = torch.randint(0, 3, (B,), generator=gen)
    hooks = GradientCapture(model, mode="fast")
    torch.nn.functional.cross_entropy(model(x, tokens), y).backward()
    fast, _ = hooks.collect()
    assert fast._records, "the fast path must be exercised"
    shift = [torch.randn(p.shape, generator=gen) * 0.3 for p in hooks.params]
    inv_b = [torch.rand(p.shape, generator=gen) * 3 + 0.1 for p in hooks.params]
    got = transformed_sq_norms(fast, shift, inv_b)
    expected = transformed_sq_norms(
        PerExampleGradients.from_tensors(fast.materialize()), shift, inv_b
    )  # a plain list: materialised path
    assert fast._full is not None
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    # the clipped transformed sum agrees as well (fast weighted sum, shifted and scaled once)
    clip = AdaCliP(h2=1.0)
    clip.setup(hooks.params)
    clip.m = shift
    hooks.clear()
    torch.nn.functional.cross_entropy(model(x, tokens), y).backward()
    lazy, _ = hooks.collect()
    sums_fast = clip.clip_and_sum(lazy, ctx(B))
    sums_full = clip.clip_and_sum(PerExampleGradients.from_tensors(lazy.materialize()), ctx(B))
    for a, b in zip(sums_fast, sums_full, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fast_norm_near_the_mean_is_recomputed_exactly():
    """An example whose gradient is almost a: the expansion's terms are ~1e6 × their sum, so fp32 would
    lose the norm; those examples are recomputed in fp64 (an underestimate could break sensitivity 1)."""
    from lightning_dp.clipping.adaclip import transformed_sq_norms
    from lightning_dp.per_example import GradientCapture

    torch.manual_seed(0)
    layer = torch.nn.Linear(30, 5)
    hooks = GradientCapture(layer, mode="fast")
    x, y = torch.randn(6, 30), torch.randint(0, 5, (6,))
    torch.nn.functional.cross_entropy(layer(x), y).backward()
    grads, _ = hooks.collect()
    full = [g.double() for g in grads.materialize()]
    grads._full = None  # back to the lazy (fast) path for the same records
    shift = [g[0] + 1e-3 * torch.randn_like(g[0]) for g in full]
    inv_b = [torch.full_like(g[0], 10.0) for g in full]
    expected = sum(((g - a) * ib).square().flatten(1).sum(1) for g, a, ib in zip(full, shift, inv_b))
    got = transformed_sq_norms(grads, [a.float() for a in shift], [ib.float() for ib in inv_b])
    assert float(expected[0]) < 1e-3 * float(expected[1:].min())
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=0)
