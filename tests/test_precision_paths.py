"""The checks cover the computation the real step makes (issue #47, review items A2 and A4): in the run's own
reduced precision, and in the hooks that run inside the optimizer step.

Each leak trains through the Trainer with the defaults a user gets and is refused before the release it
would break; each control (ordinary code that reads no other example) trains.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_edges import Classifier, data, fit, refused
from torch import Tensor, nn

from lightning_dp import DPStrategy

pytestmark = pytest.mark.filterwarnings("ignore")

PATH = "the two made different torch operations"

# -- A2. a step that computes something else in reduced precision ------------------------------------------


def _reduced(x: Tensor, module: Classifier, branch: str) -> bool:
    """Whether the step is in reduced precision, read the way ``branch`` reads it."""
    if branch == "tensor":
        return x.dtype == torch.bfloat16
    if branch == "autocast":
        return torch.is_autocast_enabled(x.device.type)
    if branch == "self_dtype":
        return module.dtype != torch.float32
    return torch.get_default_dtype() != torch.float32


class Branching(Classifier):
    """Centres the hidden layer by the batch's mean, only in reduced precision (the fp32 path is exact)."""

    def __init__(self, branch: str) -> None:
        super().__init__()
        self.branch = branch

    def forward(self, x: Tensor) -> Tensor:
        h = self.l1(x)
        if _reduced(h, self, self.branch):
            h = h - h.mean(0)
        return self.l2(torch.relu(h))


class SmoothedInBf16(Classifier):
    """Label smoothing towards the batch's class frequencies in bf16 only: a small move per example."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        target = F.one_hot(y, 3).float()
        if logits.dtype == torch.bfloat16:
            target = 0.97 * target + 0.03 * torch.bincount(y, minlength=3).float() / len(y)
        return -(target * F.log_softmax(logits.float(), 1)).sum(1).mean()


@pytest.mark.parametrize(
    ("branch", "precision"),
    [
        ("tensor", "bf16-mixed"),
        ("autocast", "bf16-mixed"),
        ("tensor", "bf16-true"),
        ("self_dtype", "bf16-true"),
        ("default_dtype", "bf16-true"),
    ],
)
def test_a_step_that_branches_on_the_precision_is_refused_before_its_first_release(branch, precision):
    message = refused(Branching(branch), data(24), 24, PATH, precision=precision)
    assert "24" not in message


def test_a_small_branch_at_a_large_batch_is_refused_too():
    refused(SmoothedInBf16(), data(1024), 1024, PATH, max_steps=1, precision="bf16-mixed")


def test_the_branch_moves_the_released_sum_by_more_than_c_and_its_fp32_path_does_not(neighbour):
    """What the refusal prevents, shown by the neighbour test with the check off."""

    def unchecked() -> DPStrategy:
        return DPStrategy(noise_multiplier=0.0, max_grad_norm=1e-3, check_sensitivity=False)

    torch.manual_seed(0)
    module, dataset = Branching("tensor"), data(16, outlier=True)
    outlier = int(dataset.tensors[0][:, 0].argmax())  # its removal moves the batch's mean most
    bf16 = neighbour.neighbour_move(module, dataset, unchecked, removed=outlier, precision="bf16-mixed")
    assert bf16.l2 > 1.2 * bf16.max_grad_norm
    neighbour.assert_neighbour_bound(neighbour.neighbour_move(module, dataset, unchecked, removed=outlier))


class CastsToSelfDtype(Classifier):
    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.to(self.dtype))


class UpcastsInReducedPrecision(Classifier):
    """Computes the hidden activation in fp32 where the run is in bf16: a cast, the same computation."""

    def forward(self, x: Tensor) -> Tensor:
        h = self.l1(x)
        if h.dtype != torch.float32:
            h = h.float()
        return self.l2(torch.relu(h).to(self.l2.weight.dtype))


class WithDropout(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.3)

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(self.drop(torch.relu(self.l1(x)) + 0.1 * torch.randn(x.shape[0], 8)))


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
@pytest.mark.parametrize("b", [8, 1024])
@pytest.mark.parametrize("model", [Classifier, CastsToSelfDtype, UpcastsInReducedPrecision, WithDropout])
def test_ordinary_models_train_in_reduced_precision(model, b, precision):
    assert fit(model(), data(b), b, max_steps=1, precision=precision).checks.mixing.checked_steps == [0]
