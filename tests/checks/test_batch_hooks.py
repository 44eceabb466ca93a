"""The user's per-batch hooks a dry pass re-runs (``checks/batch_hooks.py``), tested directly."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.callbacks import LearningRateMonitor

from lightning_dp import DPConfigurationError
from lightning_dp.checks.batch_hooks import batch_hooks, hook_note, run_batch_hooks


class _Plain(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.seen: list[tuple[str, int]] = []


class _Hooked(_Plain):
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.seen.append(("transfer", dataloader_idx))
        return batch

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.seen.append(("start", batch_idx))


class _Counting(Callback):
    def __init__(self) -> None:
        self.calls = 0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.calls += 1


def test_only_the_users_own_hooks_are_replayed_in_lightnings_order() -> None:
    assert batch_hooks(_Plain()) == []
    assert hook_note(_Plain()) == ""
    module = _Hooked()
    callback = _Counting()
    module._trainer = SimpleNamespace(callbacks=[LearningRateMonitor(), callback])  # type: ignore[assignment]
    names = [hook.name for hook in batch_hooks(module, batch_idx=7)]
    assert names == [
        "_Hooked.on_after_batch_transfer",
        "_Counting.on_train_batch_start",
        "_Hooked.on_train_batch_start",
    ]
    run_batch_hooks(module, torch.zeros(2, 2), 7)
    assert module.seen == [("transfer", 0), ("start", 7)]
    assert callback.calls == 1
    assert "_Hooked.on_train_batch_start" in hook_note(module, 7)


def test_a_hook_that_raises_on_the_checks_batch_is_refused_by_name() -> None:
    class Raising(_Plain):
        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            raise ValueError("not on this batch")

    with pytest.raises(DPConfigurationError, match=r"Your Raising\.on_train_batch_start raised ValueError"):
        run_batch_hooks(Raising(), torch.zeros(2, 2), 0)
