"""Each mechanism works with its defaults on a user's model, or says at run time what to change (#21)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TinyModule, make_trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import AdaCliP, AdaptiveGD, DPStrategy, HeavyBall, Nesterov
from lightning_dp.clipping.adaclip import SATURATED_FRACTION
from lightning_dp.per_example import PerExampleGradients
from lightning_dp.slots import StepContext
from recipes.linear import LinearClassifier


def _ctx(step: int, max_grad_norm: float = 1.0) -> StepContext:
    return StepContext(
        step=step,
        batch_size=1,
        expected_batch_size=1.0,
        max_grad_norm=max_grad_norm,
        noise_multiplier=0.0,
        generator=torch.Generator(),
    )


@pytest.mark.parametrize("make", [lambda: HeavyBall(beta=0.9), lambda: Nesterov(momentum=0.9)])
def test_momentum_steps_keep_the_optimizers_lr_as_the_effective_step(make):
    """A tuned DP-SGD lr swapped into a momentum step moves as far per step in the long run, not 10×."""
    step = make()
    p = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([p], lr=0.1)
    points = []
    for k in range(400):
        p.grad = torch.ones(1)
        step.step(optimizer, _ctx(k))
        points.append(float(p.detach()))
    assert points[-1] - points[-2] == pytest.approx(-0.1, rel=1e-3)  # DP-SGD's step at lr 0.1
    paper = type(step)(**({"beta": 0.9} if isinstance(step, HeavyBall) else {"momentum": 0.9}))
    paper.step_size = "paper"
    q = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([q], lr=0.1)
    for k in range(400):
        q.grad = torch.ones(1)
        paper.step(optimizer, _ctx(k))
    assert float(q.detach()) == pytest.approx(10 * points[-1], rel=1e-2)  # α = lr: 1/(1 − β) as far


def test_adaclip_default_h2_makes_step_zero_a_dp_sgd_with_clip_c():
    """h2 = C²/(p·d) and s_0 = C/sqrt(d): b = C uniformly, so the first step clips each gradient at norm C."""
    clip = AdaCliP()
    params = [torch.zeros(3, 4), torch.zeros(4)]
    clip.setup(params)
    c = 2.0
    g = [torch.full((2, 3, 4), 5.0), torch.full((2, 4), 5.0)]  # two examples, norm 5·√16 = 20 each
    sums = clip.clip_and_sum(PerExampleGradients.from_tensors(g), _ctx(0, max_grad_norm=c))
    assert clip.h2 == pytest.approx(c * c / (SATURATED_FRACTION * 16))
    assert clip.init_std == pytest.approx(c / 4)
    for b in clip._b:
        torch.testing.assert_close(b, torch.full_like(b, c))
    # Transformed space: each example clipped to norm 1; mapped back by b = C: norm C each, sum 2C.
    total = math.sqrt(sum(float((s * b).square().sum()) for s, b in zip(sums, clip._b, strict=True)))
    assert 2 * c * (1 - 1e-4) <= total <= 2 * c  # clip_factors keeps a 1e-5 margin below the bound


def test_adaclip_default_stays_a_dp_sgd_with_clip_c_where_the_noise_dominates():
    """On the MNIST CNN (C = 0.1, d = 26,010, B = 512) AdaCliP() lost to DP-SGD with no message: with
    h2 = C²/d the noise-dominated variance samples hit the clamp h2 about a third of the time, so b
    settled at ≈ 0.55·C, a 0.55× step for a learning rate tuned at C. Here d·σ²/B ≈ 31, as there."""
    d, batch, z, c = 2000, 64, 1.0, 0.1
    clip = AdaCliP()
    clip.setup([torch.zeros(d)])
    g = torch.Generator().manual_seed(0)
    scales = []
    for step in range(200):
        ctx = StepContext(
            step=step, batch_size=batch, expected_batch_size=float(batch), max_grad_norm=c,
            noise_multiplier=z, generator=g,
        )  # fmt: skip
        grads = torch.randn(batch, d, generator=g) * (10 * c / math.sqrt(d))  # all clipped, mean 0
        sums = clip.clip_and_sum(PerExampleGradients.from_tensors([grads]), ctx)
        clip.finalize([s + z * torch.randn(s.shape, generator=g) for s in sums], ctx)
        scales.append(float(clip._b[0].mean()) / c)
    settled = sum(scales[100:]) / 100
    assert 0.85 <= settled <= 1.15, settled


def test_adaclip_h2_far_from_the_clip_warns_with_the_fix():
    clip = AdaCliP(h2=1e-2)
    clip.setup([torch.zeros(4800)])
    with pytest.warns(UserWarning, match=r"Use h2 ≈ C²/\(p·d\) = 0\.000657"):
        clip.clip_and_sum(PerExampleGradients.from_tensors([torch.ones(2, 4800)]), _ctx(0))
    quiet = AdaCliP(h2=1.0 / (SATURATED_FRACTION * 4800))
    quiet.setup([torch.zeros(4800)])
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet.clip_and_sum(PerExampleGradients.from_tensors([torch.ones(2, 4800)]), _ctx(0))


def _agd_fit(tmp_path, *, max_epochs: int, batch_size: int | None = None) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(200, 5, generator=g)
    y = ((x - 0.5) @ torch.randn(5, generator=g) > 0).long()
    module = LinearClassifier(5)
    trainer = make_trainer(
        DPStrategy(step=AdaptiveGD(), target_epsilon=1.0, delta=1e-6, seed=0), tmp_path, max_epochs=max_epochs
    )
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=batch_size or len(y)))


def test_adaptive_gd_cut_off_by_the_trainer_names_the_unspent_budget(tmp_path):
    """On 2d4380a the Trainer stopped DP-AGD at max_epochs with ε 2.05 of 3 spent, silently."""
    with pytest.warns(
        UserWarning, match=r"max_epochs=2 stopped training first: ε = .* of target_epsilon = 1"
    ):
        _agd_fit(tmp_path, max_epochs=2)


def test_adaptive_gd_on_minibatches_says_they_buy_no_amplification(tmp_path):
    with pytest.warns(UserWarning, match="no amplification by subsampling"):
        _agd_fit(tmp_path, max_epochs=1, batch_size=50)


def test_dp_sgd_with_a_plan_does_not_warn_about_its_length(tmp_path):
    import warnings

    module = TinyModule(n=64, batch_size=16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(DPStrategy(target_epsilon=2.0, seed=0), tmp_path, max_epochs=1).fit(module)
    assert not [w for w in caught if "stopped training first" in str(w.message)]


def test_noise_dividing_says_when_early_steps_drown():
    """On the digits MLP, Nesterov(0.9) + NoiseDividing() lost 10 points to DP-SGD with no message."""
    from lightning_dp import NoiseDividing
    from lightning_dp.sampling import Poisson

    sampler = Poisson(seed=0)
    sampler.bind(100, 100)  # q = 1 keeps the calibration cheap
    noise = NoiseDividing()
    noise.link_step(Nesterov(momentum=0.9))
    with pytest.warns(UserWarning, match=r"NoiseDividing\(uniform=True\)"):
        noise.calibrate(3.0, 1e-5, sampler, 150, "rdp")
    assert noise.sigmas is not None
    assert max(noise.sigmas) / min(noise.sigmas) > 3


def test_line_search_says_when_its_gradients_get_much_more_noise_than_dp_sgds():
    """On the digits MLP at ε = 1 its filter and searches leave the gradients ~1.4× DP-SGD's σ (13 points
    of accuracy in bench/mechanisms.py): the run says so and names the fix; at ε = 8 the gap is small."""
    from mechanism_runs import run

    said = run("digits", "LineSearch()", 0, 1.0, 2).said
    assert any("LineSearch's gradients get noise" in s for s in said), said
    assert not any(
        "LineSearch's gradients get noise" in s for s in run("digits", "LineSearch()", 0, 8.0, 2).said
    )
