"""The accelerated steps and noise dividing inside a Trainer: equivalences, pricing, refusals, resume."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from conftest import TinyModule, make_trainer
from lightning.pytorch import Callback

from lightning_dp import (
    DPStrategy,
    FixedSize,
    HeavyBall,
    L1Clipping,
    MultiStageNesterov,
    Nesterov,
    NoiseDividing,
)
from lightning_dp.core.errors import DPConfigurationError


def _weights(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def test_heavy_ball_with_beta_zero_is_dp_sgd():
    plain = TinyModule(n=64, batch_size=16)
    shb = copy.deepcopy(plain)
    make_trainer(DPStrategy(noise_multiplier=1.0, seed=3), max_epochs=2).fit(plain)
    make_trainer(DPStrategy(noise_multiplier=1.0, seed=3, step=HeavyBall(beta=0.0)), max_epochs=2).fit(shb)
    for a, b in zip(_weights(plain), _weights(shb), strict=True):
        torch.testing.assert_close(a, b)
    moving = copy.deepcopy(TinyModule(n=64, batch_size=16))
    make_trainer(DPStrategy(noise_multiplier=1.0, seed=3, step=HeavyBall(beta=0.9)), max_epochs=2).fit(moving)
    assert any(not torch.equal(a, b) for a, b in zip(_weights(plain), _weights(moving), strict=True))


def test_gaussian_noise_dividing_records_each_sigma_and_meets_target():
    strategy = DPStrategy(target_epsilon=2.0, seed=0, step=Nesterov(momentum=0.5), noise=NoiseDividing())
    make_trainer(strategy, max_epochs=6).fit(TinyModule(n=64, batch_size=64))  # q = 1 keeps RDP cheap
    history = strategy.ledger.history
    sigmas = [event.noise_multiplier for event, _ in history]
    assert strategy.ledger.steps == 6
    assert len(history) == 6
    assert all(a > b for a, b in itertools.pairwise(sigmas))  # the noise decreases
    assert 2.0 * (1 - 1e-3) < strategy.epsilon <= 2.0


def test_paper_mode_spends_exactly_epsilon_by_basic_composition():
    module = TinyModule(n=128, batch_size=32)
    strategy = DPStrategy(
        target_epsilon=1.0,
        accountant="pure",
        max_grad_norm=5.0,
        seed=0,
        sampler=FixedSize(seed=0),
        clipping=L1Clipping(),
        noise=NoiseDividing(privacy="paper"),
        step=MultiStageNesterov(lr=0.1, mu=0.1, L=1.0, n1=3),
    )
    make_trainer(strategy, max_epochs=3).fit(module)
    assert strategy.ledger.steps == 12
    assert abs(strategy.epsilon - 1.0) < 1e-9
    assert strategy.epsilon <= 1.0
    assert set(module.seen_batch_sizes[-12:]) == {32}  # fixed-size batches (after the sensitivity check)
    assert {event.kind for event, _ in strategy.ledger.history} == {"pure_laplace"}


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(sampler=FixedSize()),
        dict(noise=NoiseDividing(privacy="paper")),
        dict(sampler=FixedSize(), clipping=L1Clipping(), noise=NoiseDividing(privacy="paper")),  # RDP ledger
        dict(accountant="pure"),
    ],
)
def test_mixes_the_ledger_cannot_price_are_refused(kwargs):
    with pytest.raises(DPConfigurationError, match="cannot price"):
        DPStrategy(target_epsilon=1.0, **kwargs)


def test_schedule_needs_a_horizon():
    strategy = DPStrategy(target_epsilon=1.0, step=Nesterov(momentum=0.5), noise=NoiseDividing())
    with pytest.raises(DPConfigurationError, match="finite training length"):
        make_trainer(strategy, max_epochs=-1, max_steps=-1).fit(TinyModule(n=64, batch_size=16))


class _SaveAndStop(Callback):
    def __init__(self, path, epoch: int) -> None:
        self.path, self.epoch = path, epoch

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(self.path)
            trainer.should_stop = True


def _nag_strategy() -> DPStrategy:
    return DPStrategy(target_epsilon=2.0, seed=1, step=Nesterov(momentum=0.7), noise=NoiseDividing())


def test_resume_continues_the_schedule_and_momentum(tmp_path):
    straight = TinyModule(n=48, batch_size=48)
    interrupted = copy.deepcopy(straight)
    make_trainer(_nag_strategy(), max_epochs=8).fit(straight)
    ckpt = tmp_path / "mid.ckpt"
    first = _nag_strategy()
    make_trainer(first, max_epochs=8, callbacks=[_SaveAndStop(ckpt, 2)]).fit(interrupted)
    assert first.ledger.steps == 3
    assert first.epsilon < 2.0
    saved = torch.load(ckpt, weights_only=True)["lightning_dp"]["slots"]
    assert saved["step"]["name"] == "Nesterov"
    assert len(saved["noise"]["state"]["sigmas"]) == 8

    resumed_module = TinyModule(n=48, batch_size=48)
    resumed = _nag_strategy()
    make_trainer(resumed, max_epochs=8).fit(resumed_module, ckpt_path=ckpt)
    assert resumed.ledger.steps == 8
    assert 2.0 * (1 - 1e-3) < resumed.epsilon <= 2.0
    for a, b in zip(_weights(straight), _weights(resumed_module), strict=True):
        torch.testing.assert_close(a, b)

    with pytest.raises(DPConfigurationError, match="horizon"):
        make_trainer(_nag_strategy(), max_epochs=9).fit(TinyModule(n=48, batch_size=48), ckpt_path=ckpt)
