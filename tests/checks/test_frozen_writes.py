"""Frozen parameters written in ``training_step`` (an EMA copy of the weights) are checked like buffers: a
write computed from the weights trains, the same as with the checks off; one computed from the batch is
refused before any release; a trained parameter written in the step is still refused."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyModule, make_trainer
from lightning.pytorch import seed_everything
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from lightning_dp import DPConfigurationError, DPStrategy


class EMAInStep(TinyModule):
    """Keeps an EMA of its weights, updated at the start of every training_step (a function of the weights)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.ema = AveragedModel(self.net, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        self.ema.requires_grad_(False)

    def training_step(self, batch, batch_idx):
        self.ema.update_parameters(self.net)
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=self.lr)


class FrozenBatchMean(TinyModule):
    """Writes the batch's mean input into a frozen parameter during the step: private data, no noise."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.centre = torch.nn.Parameter(torch.zeros(10), requires_grad=False)
        self.from_step = 0

    def training_step(self, batch, batch_idx):
        if self.global_step >= self.from_step:
            with torch.no_grad():
                self.centre.copy_(batch[0].mean(0))
        return super().training_step(batch, batch_idx)


class TrainedWrite(EMAInStep):
    """The same EMA, but the copy is left trainable: written in the step, it is refused as before."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.ema.requires_grad_(True)


def _fit(module_cls, setting, steps=4, from_step=0):
    seed_everything(0, verbose=False)
    module = module_cls(n=128, batch_size=16)
    module.from_step = from_step
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, seed=0, check_sensitivity=setting)
    make_trainer(strategy, max_steps=steps).fit(module)
    return module


@pytest.mark.parametrize("setting", [True, "every_step"])
def test_an_ema_of_the_weights_updated_in_the_step_trains_as_with_the_checks_off(setting):
    checked, unchecked = _fit(EMAInStep, setting), _fit(EMAInStep, False)
    assert int(checked.ema.n_averaged) == int(unchecked.ema.n_averaged) == 4
    for a, b in zip(checked.state_dict().values(), unchecked.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_a_frozen_parameter_written_from_the_first_batch_is_refused_before_any_release():
    with pytest.raises(DPConfigurationError, match=r"\['centre'\] were written"):
        _fit(FrozenBatchMean, True)


def test_a_frozen_parameter_written_from_a_later_batch_is_refused_before_that_release_on_checked_steps():
    with pytest.raises(DPConfigurationError, match=r"centre.*written from the batch") as refused:
        _fit(FrozenBatchMean, "every_step", from_step=2)
    assert "step 2" in str(refused.value)


def test_with_sampled_checks_a_frozen_parameter_written_from_the_batch_makes_the_next_step_a_checked_one():
    with pytest.raises(DPConfigurationError, match=r"centre.*written from the batch") as refused:
        _fit(FrozenBatchMean, True, steps=8, from_step=2)
    assert "step 2" in str(refused.value) or "step 3" in str(refused.value)


def test_a_trained_parameter_written_in_the_step_is_still_refused_and_the_message_says_how_to_keep_an_ema():
    with pytest.raises(DPConfigurationError, match=r"requires_grad_\(False\)"):
        _fit(TrainedWrite, True)
