"""The engine's check that per-example gradients add up to autograd's (``engine/consistency.py``), through
the Trainer: a registered kernel pair that misses part of its layer's gradient is refused at the first
release, by the parameter's name, and the refusal holds no figure computed from the batch's gradients."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import make_trainer
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy
from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.per_example.kernels import KernelPair
from lightning_dp.per_example.kernels.registry import FAST_CLIPPERS, Grads, KernelCall, register_fast_clipper


class Scale(nn.Module):
    """An elementwise learned scale: y = x * w."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight


class HalfScaleKernels(KernelPair):
    """A wrong kernel pair: each example's gradient is half of what autograd gives it."""

    @staticmethod
    def _samples(call: KernelCall) -> Tensor:
        return 0.5 * (call.activations[0] * call.backprops).float()

    @staticmethod
    def sq_norms(call: KernelCall) -> Grads:
        return {call.layer.weight: HalfScaleKernels._samples(call).square().sum(1)}

    @staticmethod
    def weighted_grad(call: KernelCall, weights: Tensor) -> Grads:
        return {call.layer.weight: weights.float() @ HalfScaleKernels._samples(call)}


class ScaledClassifier(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.scale = Scale(6)
        self.head = nn.Linear(6, 3)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.scale(x)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.fixture
def half_scale_kernels():
    register_fast_clipper(Scale)(HalfScaleKernels)
    yield
    FAST_CLIPPERS.pop(Scale, None)


def test_a_kernel_that_misses_part_of_a_gradient_is_refused_by_name_with_no_figure(half_scale_kernels):
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))
    strategy = DPStrategy(noise_multiplier=0.0, max_grad_norm=1e6, seed=0)
    with pytest.raises(DPConfigurationError, match=r"parameters \['scale.weight'\] do not add up") as refusal:
        make_trainer(strategy, max_steps=1).fit(ScaledClassifier(), DataLoader(data, batch_size=16))
    message = str(refusal.value).split("[docs/")[0]
    assert not re.search(r"\d\.\d|\de-\d|gap", message), message  # the gap is a statistic of the batch
    assert strategy.engine.steps == 0  # nothing released
