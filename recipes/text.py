"""A small text model for the mechanisms table: Embedding → GRU → Linear on a synthetic sequence task.

The task needs word order, so a bag of words cannot solve it: each row counts up or down by one from a
random token (mod the vocabulary), the label is the direction, a random fraction of tokens is replaced
by noise, and rows end in a padded tail of random length. No download.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["SequenceDirectionDataModule", "TextClassifier", "direction_data"]


def direction_data(
    size: int, seq_len: int, vocab_size: int, noise: float = 0.2, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """(token ids [N, T] with 0 as padding, lengths [N], labels [N]): up (1) or down (0) by one a step."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (size,), generator=g)
    start = torch.randint(0, vocab_size - 1, (size, 1), generator=g)
    step = (2 * labels - 1)[:, None] * torch.arange(seq_len)[None, :]
    ids = (start + step) % (vocab_size - 1) + 1
    noisy = torch.rand(size, seq_len, generator=g) < noise
    ids = torch.where(noisy, torch.randint(1, vocab_size, (size, seq_len), generator=g), ids)
    lengths = torch.randint(max(2, seq_len // 2), seq_len + 1, (size,), generator=g)
    ids = ids * (torch.arange(seq_len)[None, :] < lengths[:, None])
    return ids, lengths, labels


class SequenceDirectionDataModule(L.LightningDataModule):
    """:func:`direction_data` split into train/val/test (fixed seeds), batches of (ids, lengths, labels)."""

    def __init__(
        self,
        size: int = 4000,
        seq_len: int = 16,
        vocab_size: int = 64,
        noise: float = 0.2,
        batch_size: int = 128,
    ) -> None:
        super().__init__()
        self.size, self.seq_len, self.vocab_size, self.noise = size, seq_len, vocab_size, noise
        self.batch_size = batch_size
        self.train_set: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        parts = [direction_data(n, self.seq_len, self.vocab_size, self.noise, seed) for seed, n in
                 enumerate((self.size, self.size // 5, self.size // 5))]  # fmt: skip
        self.train_set, self.val_set, self.test_set = (TensorDataset(*p) for p in parts)

    def train_dataloader(self) -> DataLoader[tuple[Tensor, ...]]:
        assert self.train_set is not None
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader[tuple[Tensor, ...]]:
        return DataLoader(self.val_set, batch_size=512)

    def test_dataloader(self) -> DataLoader[tuple[Tensor, ...]]:
        return DataLoader(self.test_set, batch_size=512)


class TextClassifier(L.LightningModule):
    """Embedding → GRU (batch first) → Linear on the last real token's state; SGD. Logs ``val_acc`` and
    ``test_acc``; ``dp_per_sample_loss`` gives the unreduced losses (for the loss-probe mechanisms)."""

    def __init__(self, vocab_size: int = 64, dim: int = 32, classes: int = 2, lr: float = 1.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim, padding_idx=0)
        self.rnn = nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, classes)
        self.lr = lr

    def forward(self, ids: Tensor, lengths: Tensor) -> Tensor:
        states, _ = self.rnn(self.embed(ids))
        last = states[torch.arange(len(ids)), lengths - 1]
        return self.head(last)

    def dp_per_sample_loss(self, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        ids, lengths, labels = batch
        return F.cross_entropy(self(ids, lengths), labels, reduction="none")

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.dp_per_sample_loss(batch).mean()
        self.log("train_loss", loss)
        return loss

    def _accuracy(self, batch: tuple[Tensor, Tensor, Tensor], name: str) -> None:
        ids, lengths, labels = batch
        self.log(name, (self(ids, lengths).argmax(-1) == labels).float().mean())

    def validation_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> None:
        self._accuracy(batch, "val_acc")

    def test_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> None:
        self._accuracy(batch, "test_acc")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)
