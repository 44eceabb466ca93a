"""User code's collectives under ``dp_ddp`` and ``dp_fsdp`` (issue #48): a ``training_step`` that logs with
``sync_dist=True``, what each rank logged, and what it must have logged: the mean (and the max) over the ranks
whose call had data, never a placeholder's value. Used by tests/ddp_worker.py, tests/fsdp_worker.py and their tests."""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch import Callback

from lightning_dp import checking


class SyncLogs:
    """Mixin for a LightningModule: :meth:`log_synced` logs a loss with ``sync_dist=True`` on step (mean and max)
    and on epoch, and records each real call as [private step, value, rows] (not the checks' dry passes, nor
    placeholder calls: both are ``lightning_dp.checking()``)."""

    epoch_batch_size = False
    """Pass the call's rows as ``batch_size`` to the on-epoch log (virtual batching: Lightning would weigh each
    chunk by the whole batch)."""

    def log_synced(self, loss: Any, rows: int) -> None:
        if not checking():
            calls = self.__dict__.setdefault("sync_calls", [])
            calls.append([self.trainer.strategy.engine.steps, float(loss), rows, self.trainer.current_epoch])
        size = {"batch_size": rows} if self.epoch_batch_size else {}
        self.log("synced", loss, sync_dist=True)  # type: ignore[attr-defined]
        self.log("synced_max", loss, sync_dist=True, reduce_fx="max")  # type: ignore[attr-defined]
        self.log("synced_epoch", loss, on_step=False, on_epoch=True, sync_dist=True, **size)  # type: ignore[attr-defined]


class LoggedValues(Callback):
    """What a rank logged: after each batch [its private step, "synced", "synced_max"], and "synced_epoch" at the end."""

    def __init__(self) -> None:
        self.steps: list[list[Any]] = []
        self.epoch: float | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        metrics = trainer.callback_metrics
        values = [float(metrics[k]) if k in metrics else None for k in ("synced", "synced_max")]
        self.steps.append([trainer.strategy.engine.steps - 1, *values])

    def on_fit_end(self, trainer, pl_module) -> None:
        if "synced_epoch" in trainer.callback_metrics:
            self.epoch = float(trainer.callback_metrics["synced_epoch"])

    def record(self, module: Any) -> dict[str, Any]:
        return {
            "calls": module.__dict__.get("sync_calls", []),
            "logged": self.steps,
            "logged_epoch": self.epoch,
        }


def check_synced(ranks: list[dict[str, Any]], tol: float = 1e-6) -> int:
    """Assert that after each step every rank logged the mean and the max of the last value of each rank that
    had data in it, and at the end the mean over every real call of the last epoch, weighted by its rows. Returns how many steps
    had a rank without data (whose placeholder calls must not count)."""
    partial = 0
    for logged in zip(*(r["logged"] for r in ranks), strict=True):
        step = logged[0][0]
        assert all(entry[0] == step for entry in logged)
        last = [[c[1] for c in r["calls"] if c[0] == step][-1:] for r in ranks]
        values = [v[0] for v in last if v]
        if not values:  # no rank drew an example: nothing new is logged
            continue
        partial += len(values) < len(ranks)
        for _, mean, top in logged:
            assert math.isclose(mean, sum(values) / len(values), rel_tol=tol, abs_tol=tol), (
                step,
                mean,
                values,
            )
            assert math.isclose(top, max(values), rel_tol=tol, abs_tol=tol), (step, top, values)
    final = max(c[3] for r in ranks for c in r["calls"])
    calls = [(c[1], c[2]) for r in ranks for c in r["calls"] if c[3] == final]
    want = sum(v * n for v, n in calls) / sum(n for _, n in calls)
    for r in ranks:  # Lightning sums in fp32 over the epoch
        assert math.isclose(r["logged_epoch"], want, rel_tol=1e-5), (r["logged_epoch"], want)
    return partial
