"""Linear binary classifiers (logistic regression, linear SVM) with per-example losses for DP-AGD.

Labels are 0/1 in the data and ±1 inside the loss. Weights start at zero (DP-AGD's w_0 = 0; the logistic
loss at w_0 is ln 2). ``dp_per_sample_loss`` is the loss-probe contract of :mod:`lightning_dp.steps.loss_queries`.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LOSSES", "LinearClassifier"]

LOSSES = ("logistic", "hinge")


class LinearClassifier(L.LightningModule):
    """``w·x + b`` with the logistic loss ln(1 + e^{−y·f}) or the hinge loss max(0, 1 − y·f).

    Logs ``val_acc``/``test_acc`` (and ``val_loss``/``test_loss``); the training loss on the private
    batch is not logged. The optimizer (SGD, ``lr``) is used by DP-SGD and ignored by AdaptiveGD.

    Args:
        in_features: the input size (default 32).
        loss: ``"logistic"`` (default) or ``"hinge"``.
        lr: SGD's learning rate (default 0.1).
    """

    def __init__(self, in_features: int = 32, loss: str = "logistic", lr: float = 0.1) -> None:
        super().__init__()
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
        self.save_hyperparameters()
        self.net = nn.Linear(in_features, 1)
        nn.init.zeros_(self.net.weight)
        nn.init.zeros_(self.net.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)

    def dp_per_sample_loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Per-example loss, shape ``[B]``."""
        x, y = batch
        margin = (2.0 * y.to(x.dtype) - 1.0) * self(x)
        if self.hparams.loss == "logistic":
            return F.softplus(-margin)
        return F.relu(1.0 - margin)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.dp_per_sample_loss(batch).mean()

    def _evaluate(self, batch: tuple[torch.Tensor, torch.Tensor], prefix: str) -> None:
        x, y = batch
        acc = ((self(x) > 0).long() == y).float().mean()
        self.log(f"{prefix}_loss", self.dp_per_sample_loss(batch).mean(), batch_size=len(y))
        self.log(f"{prefix}_acc", acc, prog_bar=prefix == "val", batch_size=len(y))

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
