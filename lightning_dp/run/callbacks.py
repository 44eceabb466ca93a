"""PrivacyCallback: ε in every logger and the progress bar, a budget stop, and the privacy report."""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Protocol, cast

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from lightning_dp.core.validation import flag, number
from lightning_dp.engine import PrivateStepEngine
from lightning_dp.run.prepare import trains_privately
from lightning_dp.run.report import privacy_report, write_report
from lightning_dp.run.run_length import warn_if_budget_left, warn_on_minibatch_adaptive_step

log = logging.getLogger(__name__)


class HasPrivacyEngine(Protocol):
    """What the callback, the report and the audit read from a DP strategy: its engine."""

    @property
    def engine(self) -> PrivateStepEngine: ...


def dp_strategy_of(trainer: Trainer) -> HasPrivacyEngine:
    """The trainer's DP strategy, or a clear error when the Trainer does not train privately."""
    strategy = trainer.strategy
    if not trains_privately(strategy) or not isinstance(getattr(strategy, "engine", None), PrivateStepEngine):
        raise TypeError(
            f"PrivacyCallback needs a DP strategy (Trainer(strategy=DPStrategy(...)) or strategy='dp'), "
            f"got {type(strategy).__name__}."
        )
    return cast(HasPrivacyEngine, strategy)


def _loggers_write_now(trainer: Trainer) -> bool:
    """Whether Lightning hands this step's logged values to the loggers (its ``log_every_n_steps``
    cadence, or a stop); True where this Lightning does not say."""
    connector = getattr(trainer, "_logger_connector", None)
    return bool(getattr(connector, "should_update_logs", True))


def training_metric_names(trainer: Trainer) -> set[str]:
    """The names, as a monitor would spell them, of the metrics logged during training (not ``dp/*``).

    Read from the training loop's own result collection, so a name logged only in validation is absent;
    ``on_step=True, on_epoch=True`` logs appear under ``name``, ``name_step`` and ``name_epoch``.
    """
    results = getattr(trainer.fit_loop.epoch_loop, "_results", None)
    names: set[str] = set()
    for metric in (results or {}).values():
        meta = getattr(metric, "meta", None)
        if meta is None or meta.name.startswith("dp/"):  # released values: ε, σ, q, the line search's η
            continue
        names |= {meta.name, meta.forked_name(True), meta.forked_name(False)}
    return names


def private_monitors(trainer: Trainer) -> list[str]:
    """Callbacks (``EarlyStopping``, ``ModelCheckpoint``, any with a ``monitor``) and learning-rate schedulers
    (``ReduceLROnPlateau`` through ``configure_optimizers``) that watch a metric logged during training."""
    logged = training_metric_names(trainer)
    watchers = [
        (type(callback).__name__, getattr(callback, "monitor", None))
        for callback in trainer.callbacks  # type: ignore[attr-defined]
    ]
    watchers += [(type(config.scheduler).__name__, config.monitor) for config in trainer.lr_scheduler_configs]
    return [
        f"{name}(monitor={monitor!r})"
        for name, monitor in watchers
        if isinstance(monitor, str) and monitor in logged
    ]


class PrivacyCallback(Callback):
    """Logs ``dp/*`` metrics, stops before the step that would exceed the budget, writes the report.

    Args:
        log_every_n_steps: how often to log ε. Default: every step with the RDP accountant (reading ε
            costs microseconds), the Trainer's ``log_every_n_steps`` with PRV (about 0.1 s a reading).
        report: write ``privacy_report.json`` and ``privacy_curve.png`` into the trainer's log directory.
    """

    def __init__(self, log_every_n_steps: int | None = None, report: bool = True) -> None:
        self.log_every_n_steps = number(
            log_every_n_steps,
            "log_every_n_steps",
            owner="PrivacyCallback",
            low=1,
            integer=True,
            optional=True,
        )
        self.report = flag(report, "report", owner="PrivacyCallback")
        self.report_path: str | None = None
        self.test_metrics: dict[str, float] = {}
        self.stopped_on_budget = False
        self._monitors_checked = False

    def metrics(self, trainer: Trainer) -> dict[str, float]:
        engine = dp_strategy_of(trainer).engine
        sigma = engine.last_noise_multiplier()
        out = {
            "dp/epsilon": float(engine.ledger.epsilon()),
            "dp/delta": float(engine.delta),
            "dp/noise_multiplier": float("nan") if sigma is None else float(sigma),
            "dp/sample_rate": float(engine.sampler.sample_rate),
            "dp/steps": float(engine.steps),
        }
        out.update(engine.clipping.metrics())  # released values only, e.g. quantile clipping's C
        out.update(engine.step_slot.metrics())  # released values only, e.g. the line search's η
        return out

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        engine = dp_strategy_of(trainer).engine
        warn_on_minibatch_adaptive_step(engine)
        note = engine.noise.describe()  # correlated noise: the strategy fitted, b, rounds, predicted error
        if note is not None:
            rank_zero_info(f"lightning-dp: {note}")
        self._monitors_checked = False  # checked again in every fit
        self._stop_if_spent(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        warn_if_budget_left(trainer, dp_strategy_of(trainer).engine, self.stopped_on_budget)

    def _stop_if_spent(self, trainer: Trainer) -> None:
        """Stop before the next step when the target cannot pay for it (also right after a resume)."""
        engine = dp_strategy_of(trainer).engine
        affordable = engine.affordable_steps()
        if affordable is None or affordable >= 1:
            return
        if not trainer.should_stop:
            log.info(
                "lightning-dp: privacy budget reached (ε=%.4f of %g) after %d steps; stopping.",
                engine.ledger.epsilon(),
                engine.target_epsilon,
                engine.steps,
            )
        trainer.should_stop = True
        self.stopped_on_budget = True

    def _warn_on_private_monitors(self, trainer: Trainer) -> None:
        """Once, after the first step's logs: stopping, keeping weights or scheduling the learning rate on a
        training metric is not private."""
        if self._monitors_checked:
            return
        self._monitors_checked = True
        watchers = private_monitors(trainer)
        if watchers:
            warnings.warn(
                f"{', '.join(watchers)} watches a metric logged during training: when training stops, which "
                "checkpoint is kept or how the learning rate changes then depends on the private training data "
                "with no noise, and ε does not cover that choice. Monitor a metric computed on held-out "
                "validation data (logged in validation_step) instead, or stop and schedule on a fixed number "
                "of steps.",
                stacklevel=2,
            )

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._warn_on_private_monitors(trainer)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._warn_on_private_monitors(trainer)
        engine = dp_strategy_of(trainer).engine
        self._stop_if_spent(trainer)  # first, so that a last step's metrics reach the loggers in full
        every = self.log_every_n_steps or (1 if engine.accountant == "rdp" else trainer.log_every_n_steps)  # type: ignore[attr-defined]
        if engine.steps % max(1, every) == 0 or engine.steps == 1:
            # Each Lightning log call costs about 1 ms on CPU, and loggers receive on-step values only
            # on their own cadence: ε goes to the progress bar every time, the rest when loggers write.
            full = engine.steps == 1 or _loggers_write_now(trainer)
            for name, value in self.metrics(trainer).items():
                if full or name == "dp/epsilon":
                    pl_module.log(name, value, prog_bar=name == "dp/epsilon", on_step=True, on_epoch=False)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._write(trainer)

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.test_metrics = {
            k: float(v)
            for k, v in trainer.callback_metrics.items()
            if k.startswith("test") and v.numel() == 1
        }
        if self.report_path is not None:
            self._write(trainer)

    def _write(self, trainer: Trainer) -> None:
        if not self.report:
            return
        strategy = dp_strategy_of(trainer)
        if strategy.engine.grads is None and strategy.engine.steps == 0:
            return
        directory = trainer.log_dir or trainer.default_root_dir  # a collective under DDP: every rank asks
        if trainer.is_global_zero:
            data = privacy_report(
                strategy, stopped_on_budget=self.stopped_on_budget, test_metrics=self.test_metrics
            )
            self.report_path = write_report(data, strategy.engine.ledger, os.fspath(directory))
            log.info(
                "lightning-dp: ε = %.4f (δ = %g); report in %s",
                data["epsilon"],
                data["delta"],
                self.report_path,
            )
        else:
            self.report_path = os.path.join(os.fspath(directory), "privacy_report.json")
