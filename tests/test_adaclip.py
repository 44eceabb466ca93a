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
    sums = clip.clip_and_sum([g], ctx(2))
    close(clip.finalize(sums, ctx(2))[0], [0.9, 1.2])
    flat = FlatClipping()
    flat_ctx = ctx(2)
    flat_ctx.max_grad_norm = C
    close(flat.finalize(flat.clip_and_sum([g], flat_ctx), flat_ctx)[0], [0.9, 1.2])


@pytest.mark.parametrize(
    ("mode", "s_new"),
    [("per_example", [1.060660, 4.125869, 3.853570]), ("literal", [1.006231, 3.963760, 3.824265])],
)
def test_worked_step_without_noise(mode, s_new):
    clip = with_state([1.0, 0.0, -1.0], [1.0, 4.0, 4.0], variance_mode=mode)
    g = torch.tensor([[4.0, 6.0, -1.0], [1.0, 3.0, 2.0]])
    R = clip.clip_and_sum([g], ctx(2))[0]
    close(R, [0.707107, 1.207107, 0.5])
    close(clip.finalize([R], ctx(2))[0], [2.060660, 3.621320, 0.5])
    close(clip.s[0], s_new)
    close(clip.m[0], [1.010607, 0.036213, -0.985])


def test_worked_step_with_a_fixed_noise_draw():
    clip = with_state([1.0, 0.0, -1.0], [1.0, 4.0, 4.0])
    g = torch.tensor([[4.0, 6.0, -1.0], [1.0, 3.0, 2.0]])
    R = clip.clip_and_sum([g], ctx(2, z=0.5))[0] + 0.5 * torch.tensor([1.0, -2.0, 0.5])
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
    R = clip.clip_and_sum([g], ctx(B, z))[0]
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
    R = clip.clip_and_sum([g], ctx(5))
    torch.testing.assert_close(clip.finalize(R, ctx(5))[0], g.mean(0), rtol=1e-5, atol=1e-6)


def test_statistics_stay_clamped_and_finite():
    clip = AdaCliP(h2=1e-12)
    clip.setup([torch.zeros(3, 2), torch.zeros(4)])
    for step in range(30):
        g = [torch.randn(8, 3, 2) * 10, torch.randn(8, 4) * 1e-3]
        c = ctx(8, z=1.0)
        sums = clip.clip_and_sum(g, c)
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
