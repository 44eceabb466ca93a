"""The neighbour test: one real private step on a data set with and without one example.

DP-SGD's guarantee rests on one property: adding or removing one example moves the sum the noise is
added to by at most the sensitivity the noise is calibrated for (C for flat clipping). ``neighbour_move``
runs ONE step through the Trainer (σ = 0, q = 1 so the batch is the whole data set, fixed seed) on D
and on D minus its last example, reads that sum through the engine's ``ReleaseHook`` and returns how
far it moved. Also the pattern models the sensitivity check must refuse (they mix examples).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from conftest import TinyModule, make_trainer
from lightning.pytorch import LightningModule, seed_everything
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from lightning_dp import DPStrategy, per_example_token_loss
from lightning_dp.slots import StepContext
from lightning_dp.slots.release import ReleaseHook

MOVE_RTOL = 1e-3
"""Rounding allowance: the kept examples' contributions are computed in batches of n and n − 1 rows
(different GEMM blocking), so each may differ by ~1e-6 of C in fp32; far below the > C moves refused."""


class CaptureSum(ReleaseHook):
    """Keeps the first step's clipped sum (what the noise is added to) and its sensitivity."""

    def __init__(self, strategy: DPStrategy) -> None:
        self.strategy = strategy
        self.sums: list[Tensor] | None = None
        self.sensitivity = math.nan

    def before_noise(self, sums: list[Tensor], ctx: StepContext) -> list[Tensor]:
        if self.sums is None:
            self.sums = [s.detach().double().cpu().clone() for s in sums]
            sensitivity = ctx.extras.get("sensitivity")
            if sensitivity is None:
                sensitivity = self.strategy.engine.clipping.sensitivity(ctx)
            self.sensitivity = float(sensitivity)
        return sums


@dataclass(frozen=True)
class NeighbourMove:
    """How far one example moved the clipped sum: L2 and L1 norms, next to C and the sensitivity."""

    l2: float
    l1: float
    max_grad_norm: float
    sensitivity: float


def released_sum(
    template: LightningModule,
    dataset: Dataset[Any],
    make_strategy: Callable[[], DPStrategy],
    batch_size: int | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    **trainer_kwargs: Any,
) -> CaptureSum:
    """The first private step's clipped sum (and its sensitivity) for a copy of ``template`` on ``dataset``."""
    seed_everything(0, verbose=False)
    module = copy.deepcopy(template)
    strategy = make_strategy()
    capture = CaptureSum(strategy)
    strategy.engine.release_hooks.append(capture)
    loader = DataLoader(dataset, batch_size=batch_size or len(dataset), collate_fn=collate_fn)  # type: ignore[arg-type]
    trainer = make_trainer(strategy, max_steps=1, **trainer_kwargs)
    trainer.fit(module, train_dataloaders=loader)
    assert capture.sums is not None, "no private step ran"
    return capture


def neighbour_move(
    template: LightningModule,
    dataset: Dataset[Any],
    make_strategy: Callable[[], DPStrategy],
    batch_size: int | None = None,
    removed: int = -1,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    **trainer_kwargs: Any,
) -> NeighbourMove:
    """One step on ``dataset`` and one on ``dataset`` minus one example; how far the sum moved.

    ``batch_size`` defaults to the data set size (q = 1: Poisson takes every example); the smaller data
    set keeps the same q (``collate_fn``: the loader's, default PyTorch's). By default the removed example is last, so the others keep their rows (and
    dropout masks); ``removed=0`` takes the first (mixing that flows from earlier rows to later ones).
    """
    n = len(dataset)  # type: ignore[arg-type]
    full = released_sum(template, dataset, make_strategy, batch_size, collate_fn, **trainer_kwargs)
    smaller = None if batch_size is None else batch_size * (n - 1) // n
    out = removed % n
    rest = Subset(dataset, [i for i in range(n) if i != out])
    kept = released_sum(template, rest, make_strategy, smaller, collate_fn, **trainer_kwargs)
    assert full.sums is not None
    assert kept.sums is not None
    diffs = [a - b for a, b in zip(full.sums, kept.sums, strict=True)]
    return NeighbourMove(
        l2=math.sqrt(sum(float(d.pow(2).sum()) for d in diffs)),
        l1=sum(float(d.abs().sum()) for d in diffs),
        max_grad_norm=full.strategy.engine.max_grad_norm,
        sensitivity=full.sensitivity,
    )


def assert_neighbour_bound(move: NeighbourMove, norm: str = "l2", bound: float | None = None) -> None:
    """The sum moved by at most ``bound`` (default: the sensitivity the noise is calibrated for)."""
    limit = move.sensitivity if bound is None else bound
    value = move.l2 if norm == "l2" else move.l1
    assert value <= limit * (1 + MOVE_RTOL), (
        f"one example moved the clipped sum by {value:.4g} ({norm}), above the bound {limit:.4g}"
    )


# -- models that mix examples (pattern 3 of issue #16) and their per-example fixes -----------------------------


def token_data(n: int = 8, length: int = 24, vocab: int = 11, seed: int = 0) -> TensorDataset:
    """Token sequences padded to ``length`` with labels ``-100`` on the padding: one labelled token
    each, except the last example (all ``length``); every label is token 0 so the gradients align."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, vocab, (n, length), generator=g)
    lengths = [1] * (n - 1) + [length]
    labels = torch.full((n, length), -100)
    for i, count in enumerate(lengths):
        labels[i, :count] = 0
    return TensorDataset(tokens, labels)


class TinyLM(LightningModule):
    """Embedding + linear head over tokens. ``token_mean=True`` averages over all the batch's tokens
    (what ``F.cross_entropy`` over flattened tokens does), else each example's own tokens."""

    def __init__(self, token_mean: bool, vocab: int = 11, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)
        self.token_mean = token_mean

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        tokens, labels = batch
        logits = self.head(torch.tanh(self.embed(tokens)))
        if self.token_mean:
            return F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
            )
        return per_example_token_loss(logits, labels).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Mixup(TinyModule):
    """In-batch mixup: each input is blended with another example of the batch (a random permutation)."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        partner = torch.randperm(len(x))
        mixed = 0.5 * x + 0.5 * x[partner]
        out = self(mixed)
        return 0.5 * F.cross_entropy(out, y) + 0.5 * F.cross_entropy(out, y[partner])


class BatchStandardised(TinyModule):
    """Standardises the inputs with the batch's mean and std inside ``forward`` (a batch statistic)."""

    def forward(self, x: Tensor) -> Tensor:
        return self.net((x - x.mean(0)) / (x.std(0) + 1e-5))


def tiny_data(module: TinyModule, n: int) -> TensorDataset:
    """The first ``n`` examples of a ``TinyModule``'s own data set."""
    return TensorDataset(module.x[:n], module.y[:n])
