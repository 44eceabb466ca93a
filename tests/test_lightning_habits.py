"""Ordinary Lightning habits under DPStrategy (issue #22): reloading a model whose BatchNorm was
replaced, a custom sampler, ``on_after_backward``, custom layers with buffers. The strategy name
without an import and the wheel install are checked by ``make wheel-check`` (.ci/wheel_check.sh).
"""

from __future__ import annotations

import pickle

import pytest
import torch
from conftest import TinyModule, make_trainer
from torch import nn
from torch.utils.data import DataLoader, SubsetRandomSampler, TensorDataset, WeightedRandomSampler

import lightning_dp
from lightning_dp import DPConfigurationError, DPStrategy


class WithBatchNorm(TinyModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))


def test_model_trained_with_batchnorm_replaced_reloads_with_identical_outputs(tmp_path):
    trained = WithBatchNorm()
    trainer = make_trainer(DPStrategy(noise_multiplier=1.0, on_batchnorm="replace", seed=0), max_steps=2)
    trainer.fit(trained)
    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)

    with pytest.raises(RuntimeError, match="running_mean"):  # what Lightning alone does
        WithBatchNorm.load_from_checkpoint(path)
    reloaded = lightning_dp.load_from_checkpoint(WithBatchNorm, path)

    assert type(reloaded) is WithBatchNorm
    assert isinstance(reloaded.net[1], nn.GroupNorm)
    pickle.dumps(reloaded.net)  # the instance is of the user's own class, not a transient subclass
    trained.eval(), reloaded.eval()
    with torch.no_grad():
        assert torch.equal(reloaded(trained.x), trained(trained.x))


def test_replace_batchnorm_is_the_strategys_replacement():
    fresh, trained = WithBatchNorm(), WithBatchNorm()
    make_trainer(DPStrategy(noise_multiplier=1.0, on_batchnorm="replace"), max_steps=1).fit(trained)
    assert lightning_dp.replace_batchnorm(fresh) == ["net.1"]
    assert fresh.state_dict().keys() == trained.state_dict().keys()
    assert repr(fresh.net) == repr(trained.net)
    assert lightning_dp.replace_batchnorm(fresh) == []  # idempotent


class WithSampler(TinyModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def train_dataloader(self):
        data = TensorDataset(self.x, self.y)
        if self.kind == "weighted":
            weights = torch.where(self.y == 0, 3.0, 1.0)
            return DataLoader(data, batch_size=32, sampler=WeightedRandomSampler(weights, len(data)))
        if self.kind == "subset":
            return DataLoader(data, batch_size=32, sampler=SubsetRandomSampler(range(100)))
        return DataLoader(data, batch_size=32, shuffle=False)


@pytest.mark.parametrize("kind", ["weighted", "subset"])
def test_a_custom_sampler_is_refused_with_the_alternative(kind):
    module = WithSampler(kind)
    strategy = DPStrategy(noise_multiplier=1.0)
    with pytest.raises(DPConfigurationError, match=r"has its own sampler \(\w+Sampler\)") as err:
        make_trainer(strategy, max_steps=1).fit(module)
    assert "weight the loss per example" in str(err.value)
    assert strategy.engine.steps == 0


def test_unshuffled_loader_is_silent():
    strategy = DPStrategy(noise_multiplier=1.0)
    make_trainer(strategy, max_steps=1).fit(WithSampler("sequential"))
    assert strategy.engine.steps == 1


class GradientWatcher(TinyModule):
    """Records, at every step, whether ``on_after_backward`` sees exactly the non-private gradient."""

    def __init__(self) -> None:
        super().__init__(lr=0.05)
        self.checks: list[bool] = []

    def training_step(self, batch, batch_idx):
        self.batch = batch
        return super().training_step(batch, batch_idx)

    def on_after_backward(self) -> None:
        x, y = self.batch
        first, last = self.net[0], self.net[2]
        params = [first.weight, first.bias, last.weight, last.bias]
        with torch.enable_grad():  # the same loss from the parameters, without the hooked layers
            logits = nn.functional.linear(torch.tanh(nn.functional.linear(x, *params[:2])), *params[2:])
            expected = torch.autograd.grad(nn.functional.cross_entropy(logits, y), params)
        scale = max(float(e.abs().max()) for e in expected)
        self.checks.append(
            all(
                p.grad is not None and torch.allclose(p.grad, e, rtol=1e-4, atol=1e-5 * scale)
                for p, e in zip(params, expected)
            )
        )


def test_on_after_backward_sees_the_non_private_gradient_every_step():
    module = GradientWatcher()
    with pytest.warns(UserWarning, match="NON-private gradient"):
        make_trainer(DPStrategy(noise_multiplier=1.0, seed=0), max_steps=4).fit(module)
    assert len(module.checks) >= 3  # an empty Poisson batch never reaches the hook
    assert all(module.checks), module.checks


class Masked(nn.Module):
    """A custom layer with a constant buffer (a fixed mask): no running statistic, nothing from the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(10))
        self.register_buffer("mask", (torch.arange(10) % 3 != 0).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight * self.mask


class Running(Masked):
    """The same layer, but it keeps a running mean of the batch in its buffer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mask = 0.9 * self.mask + 0.1 * x.detach().mean(0)
        return x * self.weight - self.mask


class WithCustomLayer(TinyModule):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.net = nn.Sequential(layer, nn.Linear(10, 3))


def test_a_constant_buffer_in_a_custom_layer_trains():
    module = WithCustomLayer(Masked())
    mask = module.net[0].mask.clone()
    strategy = DPStrategy(noise_multiplier=1.0)
    make_trainer(strategy, max_steps=2).fit(module)
    assert strategy.engine.steps == 2
    assert torch.equal(module.net[0].mask, mask)
    assert not torch.equal(module.net[0].weight, torch.ones(10))


def test_a_buffer_the_forward_changes_is_refused_before_any_release():
    strategy = DPStrategy(noise_multiplier=1.0)
    with pytest.raises(DPConfigurationError, match=r"buffers \['net\.0\.mask'\] were written from the batch"):
        make_trainer(strategy, max_steps=2).fit(WithCustomLayer(Running()))
    assert strategy.engine.steps == 0
    assert strategy.epsilon == 0.0
