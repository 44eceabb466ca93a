"""CONTRIBUTING.md's walkthrough works: the toy clipping, taken verbatim from the guide, trains privately.

The class is not imported from anywhere: it is extracted from the ```python block that follows
``<!-- toy-mechanism -->`` in CONTRIBUTING.md and executed, so the guide cannot drift from a
working mechanism.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TinyModule, make_trainer

from lightning_dp import DPConfigurationError, DPStrategy, FlatClipping
from lightning_dp.accounting import PoissonGaussian, compute_epsilon
from lightning_dp.clipping import per_sample_norms
from lightning_dp.per_example import PerExampleGradients

GUIDE = Path(__file__).resolve().parents[1] / "CONTRIBUTING.md"
MARKER = "<!-- toy-mechanism -->"


def toy_source() -> str:
    text = GUIDE.read_text(encoding="utf-8")
    match = re.search(re.escape(MARKER) + r"[ \t]*\n```python[ \t]*\n(.*?)\n```[ \t]*\n", text, re.S)
    assert match, f"CONTRIBUTING.md must have a ```python block right after {MARKER}"
    return match.group(1)


@pytest.fixture(scope="module")
def toy() -> type:
    namespace: dict[str, Any] = {"__name__": "contributing_toy"}
    exec(compile(toy_source(), str(GUIDE), "exec"), namespace)
    cls = namespace["ConstantScaleClipping"]
    assert cls.__name__ == "ConstantScaleClipping"
    return cls


def _params(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def test_the_block_is_a_clipping_slot(toy):
    from lightning_dp import Clipping

    assert issubclass(toy, Clipping)
    assert "clip_and_sum" in toy.__dict__
    with pytest.raises(ValueError, match="scale"):
        toy(0.0)


@pytest.mark.parametrize(("scale", "inputs"), [(0.05, 1e3), (1.0, 1e3), (20.0, 1.0), (1e-3, 1.0)])
def test_every_per_example_contribution_is_at_most_c(toy, scale, inputs):
    """In a real fit, example i contributes exactly min(scale·‖g_i‖, C): never more than C."""

    class Recording(toy):
        def __init__(self, scale: float) -> None:
            super().__init__(scale)
            self.pairs: list[tuple[float, float]] = []  # (scale·‖g_i‖, ‖contribution_i‖)

        def clip_and_sum(self, grad_samples, ctx):
            total = super().clip_and_sum(grad_samples, ctx)
            raw = per_sample_norms(grad_samples)
            singles = []
            for i in range(grad_samples[0].shape[0]):
                one = super().clip_and_sum(
                    PerExampleGradients.from_tensors([g[i : i + 1] for g in grad_samples]), ctx
                )
                singles.append(one)
                contribution = float(
                    per_sample_norms(PerExampleGradients.from_tensors([s[None] for s in one]))[0]
                )
                self.pairs.append((self.scale * float(raw[i]), contribution))
            if singles:  # the released sum is the sum of the individual contributions
                for j, t in enumerate(total):
                    torch.testing.assert_close(t, sum(s[j] for s in singles), rtol=1e-4, atol=1e-6)
            return total

    C = 0.1
    torch.manual_seed(0)  # the initial weights: tests must not depend on the order they run in
    module = TinyModule(n=64, batch_size=16)
    module.x = module.x * inputs
    clipping = Recording(scale)
    make_trainer(DPStrategy(noise_multiplier=1.0, max_grad_norm=C, clipping=clipping, seed=0)).fit(module)

    assert len(clipping.pairs) > 30
    assert max(c for _, c in clipping.pairs) <= C
    for scaled, contribution in clipping.pairs:
        assert contribution == pytest.approx(min(scaled, C), rel=1e-4)
    if inputs > 1:  # extreme inputs: the bound is active
        assert max(s for s, _ in clipping.pairs) > 2 * C
    if scale == 1e-3:  # tiny scale: nothing is clipped, every gradient is just scaled
        assert max(s for s, _ in clipping.pairs) < C


@pytest.mark.filterwarnings("ignore:noise_multiplier=0")
def test_scale_one_equals_flat_clipping_exactly(toy):
    """σ = 0 and the same seed: scale=1 must reproduce DP-SGD's FlatClipping bit for bit."""

    base = TinyModule(n=128, batch_size=16)

    def train(clipping) -> list[torch.Tensor]:
        module = copy.deepcopy(base)  # the same initial weights for every run
        strategy = DPStrategy(noise_multiplier=0.0, max_grad_norm=1.0, clipping=clipping, seed=3)
        make_trainer(strategy, max_epochs=2).fit(module)
        assert strategy.engine.steps == 16
        return _params(module)

    initial = _params(base)
    flat = train(FlatClipping())
    ours = train(toy(1.0))
    other = train(toy(0.5))
    assert all(torch.equal(a, b) for a, b in zip(flat, ours, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(initial, ours, strict=True))  # it trained
    assert not all(torch.equal(a, b) for a, b in zip(flat, other, strict=True))  # and scale matters


def test_epsilon_equals_dp_sgd_for_the_same_sigma_q_steps(toy):
    sigma, n, batch = 1.3, 256, 32

    def run(clipping) -> DPStrategy:
        strategy = DPStrategy(noise_multiplier=sigma, clipping=clipping, seed=1)
        make_trainer(strategy, max_epochs=2).fit(TinyModule(n=n, batch_size=batch))
        return strategy

    ours, dpsgd = run(toy(3.0)), run(FlatClipping())
    steps = 2 * n // batch
    assert ours.engine.steps == dpsgd.engine.steps == steps
    assert ours.ledger.history == [(PoissonGaussian(noise_multiplier=sigma, sample_rate=batch / n), steps)]
    expected = compute_epsilon(noise_multiplier=sigma, sample_rate=batch / n, steps=steps, delta=1e-5)
    assert ours.epsilon == pytest.approx(expected, rel=1e-12)
    assert ours.epsilon == pytest.approx(dpsgd.epsilon, rel=1e-12)


def test_calibrates_the_same_sigma_as_dp_sgd(toy):
    def sigma(clipping) -> float:
        strategy = DPStrategy(target_epsilon=2.0, clipping=clipping, seed=0)
        make_trainer(strategy, max_epochs=1).fit(TinyModule(n=256, batch_size=32))
        assert strategy.epsilon <= 2.0
        return strategy.engine.noise.noise_multiplier(0)

    assert sigma(toy(4.0)) == sigma(FlatClipping())


def test_checkpoint_round_trip(toy, tmp_path):
    """Resuming continues ε and the weights exactly; a different scale or mechanism is refused."""
    sigma = 1.1

    def strategy(clipping) -> DPStrategy:
        return DPStrategy(noise_multiplier=sigma, clipping=clipping, seed=5)

    start = TinyModule(n=256, batch_size=32)
    straight = copy.deepcopy(start)
    first = make_trainer(strategy(toy(2.0)), tmp_path, max_epochs=2)
    first.fit(start)
    ckpt = tmp_path / "toy.ckpt"
    first.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)["lightning_dp"]["slots"]["clipping"]
    assert saved == {"name": "ConstantScaleClipping", "state": {"scale": 2.0}}

    resumed_module = TinyModule(n=256, batch_size=32)
    resumed = make_trainer(strategy(toy(2.0)), tmp_path, max_epochs=4)
    resumed.fit(resumed_module, ckpt_path=ckpt)
    make_trainer(strategy(toy(2.0)), tmp_path, max_epochs=4).fit(straight)
    assert resumed.strategy.engine.steps == 32
    assert resumed.strategy.epsilon == pytest.approx(
        compute_epsilon(noise_multiplier=sigma, sample_rate=1 / 8, steps=32, delta=1e-5), rel=1e-12
    )
    for a, b in zip(_params(straight), _params(resumed_module), strict=True):
        torch.testing.assert_close(a, b)

    with pytest.raises(DPConfigurationError, match=r"scale=2\.0"):
        make_trainer(strategy(toy(3.0)), tmp_path, max_epochs=4).fit(TinyModule(), ckpt_path=ckpt)
    with pytest.raises(DPConfigurationError, match="different mechanism"):
        make_trainer(strategy(FlatClipping()), tmp_path, max_epochs=4).fit(TinyModule(), ckpt_path=ckpt)
