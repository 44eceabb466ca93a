"""One trial of a private search: an ordinary DPStrategy fit, its noisy score, and a check of its realised ledger."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lightning_dp.accounting.events import PrivacyEvent
from lightning_dp.accounting.rdp import segment_rdp
from lightning_dp.commands.tuning.planning import instantiate_cli
from lightning_dp.commands.tuning.space import Score
from lightning_dp.core.errors import DPConfigurationError


# ---------------------------------------------------------------------------------------------- trials
@dataclass(frozen=True)
class TrialRun:
    """What a trial runner gets: the full LightningCLI args, its private directory and the score to compute."""

    args: list[str]
    directory: Path
    score: Score


@dataclass(frozen=True)
class TrialOutcome:
    """What a runner returns: the raw metric (a correct count over ``n``), the realised RDP and a checkpoint."""

    correct: float
    n: int
    rdp: np.ndarray
    orders: tuple[float, ...]
    checkpoint: Path | None


TrialRunner = Callable[[TrialRun], TrialOutcome]


def count_correct(model: Any, loader: Any) -> tuple[float, int]:
    """Number of (x, y) examples whose argmax prediction is y, and the number of examples (a public size)."""
    import torch

    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in loader:
            correct += int((model(x.to(model.device)).argmax(dim=-1).cpu() == y).sum())
    return float(correct), len(loader.dataset)


def run_lightning_trial(run: TrialRun) -> TrialOutcome:
    """One ordinary DPStrategy fit of ``run.args``, scored on the split its source names (not noised here)."""
    cli = instantiate_cli(run.args)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    checkpoint = run.directory / "model.ckpt"
    cli.trainer.save_checkpoint(checkpoint)
    datamodule = cli.datamodule
    if run.score.source == "private_train":
        from torch.utils.data import DataLoader

        loader = DataLoader(datamodule.train_dataloader().dataset, batch_size=256)
    else:
        loader = datamodule.val_dataloader()
    correct, n = count_correct(cli.model, loader)
    declared = cli.trainer.strategy.engine.sampler.public_size
    if run.score.source == "private_train" and declared is not None:
        n = declared  # dataset_size=: the score's divisor is the declared public size, not the real N
    ledger = cli.trainer.strategy.ledger
    return TrialOutcome(correct, n, ledger.rdp, tuple(ledger.orders), checkpoint)


def check_realised(outcome: TrialOutcome, planned: Sequence[tuple[PrivacyEvent, int]]) -> None:
    """I7: the trial's ledger must not exceed its planned training history at any order."""
    orders = tuple(outcome.orders)
    # Priced as the trial's ledger prices a run (segment_rdp: exact from EXACT_RUN equal steps on, a
    # cached upper bound below), so a trial that made exactly the planned releases passes.
    bound = sum((segment_rdp(event, count, orders) for event, count in planned), np.zeros(len(orders)))
    if not np.all(np.asarray(outcome.rdp) <= bound * (1 + 1e-12)):
        raise DPConfigurationError(
            "a trial spent more privacy than its plan (its ledger exceeds the planned history at some order), so "
            "the tuned ε would not hold and nothing is released. Check that no candidate key changes the batch "
            "size, length or noise without being a choice"
        )
