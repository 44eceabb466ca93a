"""``lightning_dp/core/batches.py``: a batch whose tensors have no row per example (a ``PackedSequence`` from the
collate_fn, a nested tensor) is refused by name before any release; packing inside the step trains."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import make_trainer
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_sequence
from torch.utils.data import DataLoader

from lightning_dp import DPConfigurationError, DPStrategy


def _sequences(n: int = 16) -> list[tuple[Tensor, int]]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 7, (n,), generator=g)
    return [(torch.randn(int(t), 3, generator=g), int(i % 2)) for i, t in enumerate(lengths)]


def padded(items: list[tuple[Tensor, int]]) -> tuple[Tensor, Tensor, Tensor]:
    x = pad_sequence([s for s, _ in items], batch_first=True)
    return x, torch.tensor([len(s) for s, _ in items]), torch.tensor([y for _, y in items])


def packed(items: list[tuple[Tensor, int]]) -> tuple[Any, Tensor]:
    x, lengths, y = padded(items)
    return pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False), y


def nested(items: list[tuple[Tensor, int]]) -> tuple[Tensor, Tensor]:
    x = torch.nested.nested_tensor([s for s, _ in items], layout=torch.jagged)
    return x, torch.tensor([y for _, y in items])


class Recurrent(LightningModule):
    """An LSTM classifier over variable-length sequences, batched by ``collate``."""

    def __init__(self, collate: Any) -> None:
        super().__init__()
        self.collate = collate
        self.lstm = nn.LSTM(3, 8, batch_first=True)
        self.head = nn.Linear(8, 2)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_sequences(), batch_size=8, collate_fn=self.collate)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if len(batch) == 3:  # the recipe: padded with lengths, packed here
            x, lengths, y = batch
            batch = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False), y
        sequences, y = batch
        _, (h, _) = self.lstm(sequences)
        return F.cross_entropy(self.head(h[-1]), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(("collate", "name"), [(packed, "PackedSequence"), (nested, "nested tensor")])
def test_a_batch_without_rows_per_example_is_refused_by_name_before_any_release(collate, name):
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
    with pytest.raises(DPConfigurationError, match=name) as refusal:
        make_trainer(strategy, max_steps=2).fit(Recurrent(collate))
    assert "collate_fn" in str(refusal.value)
    assert strategy.engine.ledger.steps == 0


def test_packing_inside_the_step_trains():
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
    make_trainer(strategy, max_steps=2).fit(Recurrent(padded))
    assert strategy.engine.ledger.steps == 2
