"""The dry pass (``checks/user_step.py``): the user's step run once, nothing logged or left behind."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision

import lightning_dp
from lightning_dp.checks.user_step import dry_training_step, training_step_loss


class _Step(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.checking_seen: list[bool] = []

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.checking_seen.append(lightning_dp.checking())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.checking_seen.append(lightning_dp.checking())
        loss = self.layer(batch).square().mean()
        self.log("loss", loss)  # detached: no trainer is needed
        return loss


def test_a_dry_pass_replays_the_hooks_and_backpropagates_inside_checking() -> None:
    module = _Step()
    dry = dry_training_step(module, torch.ones(3, 2), 0, Precision())
    assert dry.backpropagated
    assert dry.loss is not None
    assert module.layer.weight.grad is not None
    assert module.checking_seen == [True, True]  # the batch hook, then the step
    assert not lightning_dp.checking()


def test_forward_only_leaves_the_gradients_alone() -> None:
    module = _Step()
    dry = dry_training_step(module, torch.ones(3, 2), 0, Precision(), forward_only=True)
    assert not dry.backpropagated
    assert dry.loss is not None
    assert module.layer.weight.grad is None


def test_the_loss_is_read_and_the_python_state_put_back() -> None:
    module = _Step()
    loss = training_step_loss(module, torch.ones(3, 2))
    assert loss is not None
    assert loss.requires_grad
    assert module.checking_seen == []  # the step's own append is undone
