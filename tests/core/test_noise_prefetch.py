"""Gaussian noise drawn ahead on a background thread (``rng.NoisePrefetch``, used by ``Releases``): the
released gradients are bit-identical to drawing the noise in the release, checkpoints hold the generator
state from before the draws made ahead (so a seeded resume repeats the run), a release the draws do not
fit rewinds the generator, and steps whose slots draw from the noise generator themselves never use it."""

from __future__ import annotations

import torch
from conftest import TinyModule, make_trainer
from torch import nn

from lightning_dp import DPStrategy, HeavyBall
from lightning_dp.clipping import FlatClipping
from lightning_dp.core.rng import NoisePrefetch
from lightning_dp.engine import PrivateStepEngine
from lightning_dp.noise import ConstantNoise
from lightning_dp.sampling import Poisson
from lightning_dp.slots import Step
from lightning_dp.slots.release import ReleaseHook

N, BATCH = 64, 16


def _engine_run(prefetch: bool, sigmas: list[float], hook_at: int | None = None) -> tuple[list, torch.Tensor]:
    """p.grad after each step of a seeded engine run (σ per step), and the final generator state."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(30, 40), nn.ReLU(), nn.Linear(40, 3))
    x, y = torch.randn(16, 30), torch.randint(0, 3, (16,))
    noise = ConstantNoise(sigmas[0])
    engine = PrivateStepEngine(
        sampler=Poisson(seed=0), clipping=FlatClipping(), noise=noise, step=Step(), max_grad_norm=1.0,
        delta=1e-5, target_epsilon=None, accountant="rdp", loss_reduction="mean", seed=5,
    )  # fmt: skip
    assert engine.releases.prefetch_draw is not None
    if not prefetch:
        engine.releases.prefetch_draw = None
    engine.attach(model)
    engine.sampler.bind(1000, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step, sigma in enumerate(sigmas):
        noise.sigma = sigma
        if step == hook_at:  # an audit-style hook adds a tensor: the drawn noise no longer fits
            engine.release_hooks.append(AppendOne())
        nn.functional.cross_entropy(model(x), y).backward()
        engine.privatize()
        grads.append([p.grad.clone() for p in model.parameters()])
        engine.apply_step(optimizer)
        optimizer.zero_grad()
        engine.grads.clear()
    return grads, engine.state_dict()["noise_generator"]


class AppendOne(ReleaseHook):
    def before_noise(self, sums, ctx):
        return [*sums, torch.zeros(3)]

    def after_release(self, noisy, ctx):
        return noisy[:-1]


def _same(a: list, b: list) -> bool:
    return all(torch.equal(u, v) for ga, gb in zip(a, b, strict=True) for u, v in zip(ga, gb, strict=True))


def test_drawn_ahead_the_released_gradients_are_bit_identical() -> None:
    (sync, sync_state), (ahead, ahead_state) = _engine_run(False, [1.0] * 4), _engine_run(True, [1.0] * 4)
    assert _same(sync, ahead)
    assert torch.equal(sync_state, ahead_state)  # the state before the draws made for a fifth step


def test_a_release_the_draws_do_not_fit_rewinds_the_generator() -> None:
    """σ = 0 draws nothing, a hook's extra tensor changes the layout: either way the generator is rewound
    and the release draws as it would have, so the stream stays the synchronous one."""
    sigmas = [1.0, 0.0, 1.0, 1.0, 1.0]
    (sync, sync_state), (ahead, ahead_state) = _engine_run(False, sigmas, 3), _engine_run(True, sigmas, 3)
    assert _same(sync, ahead)
    assert torch.equal(sync_state, ahead_state)


def test_prefetch_take_and_cancel() -> None:
    g = torch.Generator().manual_seed(1)
    before = g.get_state()
    layout = NoisePrefetch.layout([torch.zeros(3, 4), torch.zeros(70_000)])
    assert layout is not None
    assert NoisePrefetch.layout([torch.zeros(4, 3).t()]) is None  # not contiguous: drawn in the release
    prefetch = NoisePrefetch()
    prefetch.start(g, layout, 1 << 16)
    assert torch.equal(prefetch.state_before(g), before)
    assert prefetch.state_before(torch.Generator()) is None
    assert prefetch.take(g, NoisePrefetch.layout([torch.zeros(3, 4)])) is None  # another layout: rewound
    assert torch.equal(g.get_state(), before)
    prefetch.start(g, layout, 1 << 16)
    drawn = prefetch.take(g, layout)
    assert drawn is not None
    expected = torch.Generator().manual_seed(1)
    assert torch.equal(drawn[0], torch.randn(3, 4, generator=expected))
    assert torch.equal(drawn[1][:65536], torch.randn(65536, generator=expected))  # the release's slices


def test_only_the_default_step_and_noise_draw_ahead() -> None:
    """A step slot may draw from the noise generator itself, a noise slot may draw differently (or, as
    the audit's tests do, be patched not to draw): then the release draws its noise itself."""
    assert DPStrategy(noise_multiplier=1.0).engine.releases._draws_ahead()
    assert not DPStrategy(noise_multiplier=1.0, step=HeavyBall()).engine.releases._draws_ahead()

    class Doubled(ConstantNoise):
        def add_noise(self, sums, std, generator):
            return super().add_noise(sums, 2 * std, generator)

    assert not DPStrategy(noise=Doubled(1.0)).engine.releases._draws_ahead()


def _checkpoint(tmp_path, prefetch: bool) -> dict:
    """The lightning-dp state of a seeded two-step fit's checkpoint, noise drawn ahead or not."""
    strategy = DPStrategy(noise_multiplier=1.0, seed=3)
    if not prefetch:
        strategy.engine.releases.prefetch_draw = None
    trainer = make_trainer(strategy, tmp_path, max_steps=2, max_epochs=5)
    trainer.fit(TinyModule(n=N, batch_size=BATCH))
    if prefetch:  # the third step's noise is being drawn (or already is) as the checkpoint is written
        assert strategy.engine.releases.prefetch.state_before(strategy.engine.generator) is not None
    path = tmp_path / "two.ckpt"
    trainer.save_checkpoint(path)
    return torch.load(path, weights_only=True)["lightning_dp"]


def test_a_checkpoint_holds_the_generator_state_from_before_the_draws_made_ahead(tmp_path) -> None:
    """What a checkpoint saves is what the run without drawing ahead saves, so a seeded resume draws the
    third step's noise again (resume semantics unchanged)."""
    ahead, sync = _checkpoint(tmp_path / "a", True), _checkpoint(tmp_path / "b", False)
    assert torch.equal(ahead["noise_generator"], sync["noise_generator"])
