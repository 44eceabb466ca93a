"""A plain Lightning image/tabular classifier. It knows nothing about differential privacy."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from recipes.models import logistic_regression, mlp, small_cnn_digits, tramer_boneh_cnn

__all__ = ["ARCHITECTURES", "ImageClassifier", "build_model"]

ARCHITECTURES = ("mlp", "logreg", "tramer_boneh_cnn", "digits_cnn", "scatternet_cnn")


def build_model(
    arch: str,
    num_classes: int = 10,
    in_features: int = 64,
    hidden: list[int] | None = None,
    activation: str = "relu",
) -> nn.Module:
    """Build one of :data:`ARCHITECTURES` (``hidden`` defaults to ``[128]`` for ``mlp``).

    Args:
        arch: ``"mlp"``, ``"logreg"``, ``"tramer_boneh_cnn"``, ``"digits_cnn"`` or ``"scatternet_cnn"``.
        num_classes: the number of classes (default 10).
        in_features: the flattened input size for ``mlp``/``logreg``, the ScatterNet channels for
            ``scatternet_cnn`` (default 64, the digits).
        hidden: the MLP's hidden widths (default [128]).
        activation: one of relu, tanh, sigmoid, elu, gelu, silu, leaky_relu (default relu; ``digits_cnn``
            keeps tanh).
    """
    if arch == "mlp":
        return mlp(in_features, [128] if hidden is None else list(hidden), num_classes, activation)
    if arch == "logreg":
        return logistic_regression(in_features, num_classes)
    if arch == "tramer_boneh_cnn":
        return tramer_boneh_cnn(num_classes, activation)
    if arch == "digits_cnn":
        return small_cnn_digits(num_classes)
    if arch == "scatternet_cnn":  # in_features = ScatterNet channels (81 gray, 243 colour)
        from recipes.scatternet import scatternet_cnn

        return scatternet_cnn(in_features, num_classes, activation)
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHITECTURES}")


class ImageClassifier(L.LightningModule):
    """Cross-entropy classifier around a model from :mod:`recipes.models` (held in ``self.net``).

    Logs ``train_loss`` (mean over the batch), ``val_loss``/``val_acc`` and ``test_loss``/``test_acc``.
    ``dp_per_sample_loss`` returns the unreduced per-example losses for algorithms that need them.

    Args:
        arch: the network (:func:`build_model`; default ``"mlp"``).
        num_classes: the number of classes (default 10).
        in_features: the flattened input size, or the ScatterNet channels (default 64).
        hidden: the MLP's hidden widths (default [128]).
        activation: one of relu, tanh, sigmoid, elu, gelu, silu, leaky_relu (default relu).
        lr: the learning rate (default 0.1).
        momentum: SGD's momentum (default 0).
        optimizer: ``"sgd"`` (default) or ``"adam"``.
        weight_decay: L2 weight decay (default 0).
    """

    def __init__(
        self,
        arch: str = "mlp",
        num_classes: int = 10,
        in_features: int = 64,
        hidden: list[int] | None = None,
        activation: str = "relu",
        lr: float = 0.1,
        momentum: float = 0.0,
        optimizer: str = "sgd",
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        if optimizer.lower() not in ("sgd", "adam"):
            raise ValueError(f"optimizer must be 'sgd' or 'adam', got {optimizer!r}")
        self.save_hyperparameters()
        self.net = build_model(arch, num_classes, in_features, hidden, activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def dp_per_sample_loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Per-example cross-entropy, shape ``[B]``; its mean is the training loss."""
        x, y = batch
        return F.cross_entropy(self(x), y, reduction="none")

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y, reduction="mean")
        self.log("train_loss", loss, on_step=True, on_epoch=True, batch_size=len(y))
        return loss

    def _evaluate(self, batch: tuple[torch.Tensor, torch.Tensor], prefix: str) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y, reduction="mean")
        acc = (logits.argmax(dim=-1) == y).float().mean()
        self.log(f"{prefix}_loss", loss, on_epoch=True, batch_size=len(y))
        self.log(f"{prefix}_acc", acc, on_epoch=True, prog_bar=prefix == "val", batch_size=len(y))
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._evaluate(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._evaluate(batch, "test")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        if hp.optimizer.lower() == "adam":
            return torch.optim.Adam(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        return torch.optim.SGD(
            self.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay
        )
