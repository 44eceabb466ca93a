"""The dry passes see what the real step sees: the user's batch hooks, dry schedulers, replayed iterators.

The mixing check runs the user's ``training_step`` on the sampled batch (pass A) and on that batch with
examples changed (pass B). A statistic a hook computes from the batch (a Callback's or the module's
``on_train_batch_start``, the transfer hooks) is one of the batch that pass runs on, because each pass
re-runs the hooks the user wrote on its own batch; a scheduler stepped in ``training_step`` does not move;
an iterator or generator the module holds gives pass A, pass B and the real step the same items. A correct
program ends with the same weights, learning rates, counters and items with the checks off, at their
default and on every step.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyModule, make_trainer
from lightning.pytorch import Callback, LightningDataModule, seed_everything
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import Logger
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPConfigurationError, DPStrategy, checking
from lightning_dp.checks.batch_hooks import batch_hooks
from lightning_dp.checks.snapshot import PythonState, ReplayingIterator

SETTINGS = [True, "every_step"]
SETTING_IDS = ["default", "every-step"]

# -- 1. a batch statistic computed in a hook is checked like one computed in training_step -----------------


class ScaleByBatchStd(Callback):
    """Divides the inputs by the batch's std (set on the module at the batch's start): it mixes examples."""

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        pl_module.scale = batch[0].std(0, keepdim=True) + 1e-3


class ScaledByCallback(TinyModule):
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x / self.scale), y)


class Centred(TinyModule):
    """Subtracts the batch mean, which one of its hooks stores (the subclasses): it mixes examples."""

    def centre(self, batch: Any) -> None:
        self.mu = batch[0].mean(0, keepdim=True)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x - 3 * self.mu), y)


class CentredBeforeTransfer(Centred):
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.centre(batch)
        return batch


class CentredInTransfer(Centred):
    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        self.centre(batch)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)


class CentredAfterTransfer(Centred):
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.centre(batch)
        return batch


class CentredAtBatchStart(Centred):
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.centre(batch)


class CentringData(LightningDataModule):
    """A datamodule whose ``on_after_batch_transfer`` stores the batch mean on the model."""

    def __init__(self, model: Centred) -> None:
        super().__init__()
        self.model = model

    def train_dataloader(self) -> DataLoader:
        return self.model.train_dataloader()

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.model.centre(batch)
        return batch


def _mixing_case(case: str, n: int, batch_size: int) -> tuple[TinyModule, dict[str, Any], str]:
    """(module, fit arguments, the hook that computes the statistic) for one of the patterns."""
    if case == "callback":
        return (
            ScaledByCallback(n=n, batch_size=batch_size),
            {"callbacks": [ScaleByBatchStd()]},
            ("ScaleByBatchStd.on_train_batch_start"),
        )
    if case == "datamodule":
        module = Centred(n=n, batch_size=batch_size)
        return module, {"datamodule": CentringData(module)}, "CentringData.on_after_batch_transfer"
    kind = {
        "before_transfer": CentredBeforeTransfer,
        "transfer": CentredInTransfer,
        "after_transfer": CentredAfterTransfer,
        "batch_start": CentredAtBatchStart,
    }[case]
    hook = next(h for h in vars(kind) if h.startswith(("on_", "transfer_")))
    return kind(n=n, batch_size=batch_size), {}, f"{kind.__name__}.{hook}"


CASES = ["callback", "before_transfer", "transfer", "after_transfer", "batch_start", "datamodule"]


@pytest.mark.parametrize("setting", SETTINGS, ids=SETTING_IDS)
@pytest.mark.parametrize(("n", "batch_size"), [(256, 8), (2048, 512)], ids=["B=8", "B=512"])
@pytest.mark.parametrize("case", CASES)
def test_a_batch_statistic_computed_in_a_hook_is_refused_before_any_release(case, n, batch_size, setting):
    seed_everything(0, verbose=False)
    module, fit_kwargs, hook = _mixing_case(case, n, batch_size)
    callbacks = fit_kwargs.pop("callbacks", [])
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, check_sensitivity=setting)
    trainer = make_trainer(strategy, max_steps=3, callbacks=callbacks)
    with pytest.raises(DPConfigurationError, match="Sensitivity check failed on step 0") as refused:
        trainer.fit(module, **fit_kwargs)
    assert strategy.engine.steps == 0
    assert hook in [h.name for h in batch_hooks(module)]  # the hooks the dry passes re-ran
    assert hook in str(refused.value)  # the refusal names them


def test_the_hooks_re_run_are_the_users_own_in_lightnings_order():
    """Transfer hooks, then every callback's on_train_batch_start, then the module's; Lightning's own
    callbacks (a learning-rate monitor logs on each batch start) and lightning-dp's are not re-run."""

    class Everywhere(CentredBeforeTransfer, CentredAfterTransfer, CentredAtBatchStart):
        pass

    seed_everything(0, verbose=False)
    module = Everywhere(n=64, batch_size=16)
    names: list[list[str]] = []

    class Reader(Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            names.append([h.name for h in batch_hooks(pl_module)])

    monitor = LearningRateMonitor(logging_interval="step")
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, check_sensitivity=False)
    callbacks = [ScaleByBatchStd(), monitor, Reader()]
    make_trainer(strategy, max_steps=1, callbacks=callbacks, logger=RecordingLogger()).fit(module)
    assert names[0] == [
        "Everywhere.on_before_batch_transfer",
        "Everywhere.on_after_batch_transfer",
        "ScaleByBatchStd.on_train_batch_start",
        "Everywhere.on_train_batch_start",
    ]


# -- a hook that cannot run on the check's batch is refused by name, quoting its exception ------------------


class DuplicateRowsError(Exception):
    pass


class DistinctRows(Callback):
    """Insists that no example appears twice in a batch: pass B's replaced examples make it raise."""

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if len(torch.unique(batch[0], dim=0)) < len(batch[0]):
            raise DuplicateRowsError("a row appears twice in this batch")


class OncePerBatch(Callback):
    """Asserts it starts each batch once: the check's re-run raises, unless it skips while checking()."""

    def __init__(self, skip_checks: bool) -> None:
        self.skip_checks = skip_checks
        self.started: set[tuple[int, int]] = set()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.skip_checks and checking():
            return
        key = (trainer.current_epoch, batch_idx)
        if key in self.started:
            raise RuntimeError(f"batch {key} started twice")
        self.started.add(key)


def test_a_hook_that_raises_on_the_changed_batch_is_refused_quoting_it():
    strategy = DPStrategy(noise_multiplier=1.0, seed=0)
    trainer = make_trainer(strategy, max_steps=3, callbacks=[DistinctRows()])
    with pytest.raises(DPConfigurationError) as refusal:
        trainer.fit(TinyModule(n=128, batch_size=16))
    message = str(refusal.value)
    assert "DistinctRows.on_train_batch_start raised DuplicateRowsError: a row appears twice" in message
    assert strategy.engine.steps == 0


@pytest.mark.parametrize("setting", SETTINGS, ids=SETTING_IDS)
def test_a_hook_that_cannot_run_twice_is_refused_with_the_fix_and_trains_with_it(setting):
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, check_sensitivity=setting)
    trainer = make_trainer(strategy, max_steps=3, callbacks=[OncePerBatch(skip_checks=False)])
    with pytest.raises(DPConfigurationError) as refusal:
        trainer.fit(TinyModule(n=128, batch_size=16))
    message = str(refusal.value)
    assert "Your OncePerBatch.on_train_batch_start raised RuntimeError: batch (…, …) started twice" in message
    assert "lightning_dp.checking()" in message
    assert strategy.engine.steps == 0
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, check_sensitivity=setting)
    make_trainer(strategy, max_steps=3, callbacks=[OncePerBatch(skip_checks=True)]).fit(TinyModule(n=128))
    assert strategy.engine.steps == 3


# -- 2. correct hooks, schedulers and iterators train the same with the checks on and off --------------------


class RecordingLogger(Logger):
    """Keeps every ``log_metrics`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.records.append((step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        del params, args, kwargs


class Bookkeeping(Callback):
    """A correct callback: counts batches and rows, logs (through the module and the logger), sets a public
    warmup from the step count and a jitter from its own generator, and keeps an EMA of the weights after
    each step."""

    def __init__(self) -> None:
        self.starts = 0
        self.rows: list[int] = []
        self.ends = 0
        self.ema: dict[str, Tensor] = {}
        self.generator = torch.Generator().manual_seed(3)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.starts += 1
        self.rows.append(len(batch[0]))
        pl_module.log("rows", float(len(batch[0])))
        trainer.logger.log_metrics({"starts": float(self.starts)}, step=trainer.global_step)
        pl_module.warmup = min(1.0, (trainer.global_step + 1) / 5)
        pl_module.jitter = float(torch.rand((), generator=self.generator))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self.ends += 1
        for name, value in pl_module.state_dict().items():
            old = self.ema.get(name)
            self.ema[name] = value.clone() if old is None else 0.9 * old + 0.1 * value


class Bookkept(TinyModule):
    """Counts its transfers and batch starts in its own hooks; the loss reads the callback's public values."""

    def __init__(self) -> None:
        super().__init__(n=256, batch_size=16)
        self.transfers = 0
        self.batch_starts: list[int] = []

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.transfers += 1
        return batch

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.batch_starts.append(batch_idx)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x * (1 + 0.1 * self.jitter)), y) * self.warmup
        self.log("train_loss", loss)
        return loss


def _assert_same_weights(a: TinyModule, b: TinyModule) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


def _fit(make: Any, setting: Any, callbacks: Any = (), logger: Any = False, **kwargs: Any) -> Any:
    seed_everything(0, verbose=False)
    module = make()
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, seed=0, check_sensitivity=setting)
    trainer = make_trainer(strategy, callbacks=list(callbacks), logger=logger, log_every_n_steps=1, **kwargs)
    trainer.fit(module)
    assert strategy.engine.steps > 5
    return module, trainer, strategy


def test_correct_hooks_train_the_same_with_the_checks_on_and_off():
    runs = []
    for setting in (False, True, "every_step"):
        callback, logger = Bookkeeping(), RecordingLogger()
        monitor = LearningRateMonitor(logging_interval="step")
        module, trainer, strategy = _fit(Bookkept, setting, [callback, monitor], logger)
        runs.append((module, trainer, callback, logger, strategy))
    off, _, off_callback, off_logger, _ = runs[0]
    assert off_callback.starts == off_callback.ends == len(off_callback.rows) == off.transfers > 5
    for module, trainer, callback, logger, strategy in runs[1:]:
        assert strategy.checks.mixing.checked_steps  # the checks ran
        _assert_same_weights(off, module)
        assert (module.transfers, module.batch_starts) == (off.transfers, off.batch_starts)
        assert (callback.starts, callback.rows, callback.ends) == (
            off_callback.starts,
            off_callback.rows,
            off_callback.ends,
        )
        assert torch.equal(callback.generator.get_state(), off_callback.generator.get_state())
        assert all(torch.equal(callback.ema[k], v) for k, v in off_callback.ema.items())
        assert logger.records == off_logger.records  # nothing logged by the dry passes, the monitor's too
        assert trainer.callback_metrics.keys() == runs[0][1].callback_metrics.keys()
        for key, value in runs[0][1].callback_metrics.items():
            assert torch.equal(trainer.callback_metrics[key], value), key


class InStepScheduler(TinyModule):
    """Automatic optimization; ``training_step`` steps a per-step scheduler itself and records the lr."""

    def __init__(self, through_trainer: bool = False) -> None:
        super().__init__(n=256, batch_size=16)
        self.through_trainer = through_trainer
        self.lrs: list[float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if self.through_trainer:  # the scheduler object itself, not the handle lr_schedulers() returns
            self.trainer.lr_scheduler_configs[0].scheduler.step()
        else:
            self.lr_schedulers().step()
        self.lrs.append(self.optimizers().param_groups[0]["lr"])
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.8**step)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}


@pytest.mark.parametrize("through_trainer", [False, True], ids=["lr_schedulers()", "trainer's scheduler"])
def test_a_scheduler_stepped_in_training_step_is_not_advanced_by_the_checks(through_trainer):
    runs = [_fit(lambda: InStepScheduler(through_trainer), s) for s in (False, True, "every_step")]
    off, off_trainer, _ = runs[0]
    scheduler = off_trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch >= len(off.lrs) > 5
    for module, trainer, strategy in runs[1:]:
        assert strategy.checks.mixing.checked_steps
        _assert_same_weights(off, module)
        assert module.lrs == off.lrs
        assert trainer.optimizers[0].param_groups[0]["lr"] == off_trainer.optimizers[0].param_groups[0]["lr"]
        assert trainer.lr_scheduler_configs[0].scheduler.state_dict() == scheduler.state_dict()


PUBLIC = TensorDataset(torch.randn(2000, 10, generator=torch.Generator().manual_seed(5)))
"""Public data: a reference batch drawn from it shifts every example the same way."""


def _ramp() -> Iterator[float]:
    k = 0
    while True:
        k += 1
        yield min(1.0, k / 10)


def _jitter() -> Iterator[float]:
    """A public random factor per step, drawn from torch's global generator (the draw is replayed too)."""
    while True:
        yield 1 + 0.1 * float(torch.rand(()))


class PublicReference(Callback):
    """Sets a public reference point on the module at each batch start, from its own public iterator."""

    def __init__(self) -> None:
        self.public = iter(DataLoader(PUBLIC, batch_size=4))

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        pl_module.reference = next(self.public)[0].mean(0)


class PublicItems(TinyModule):
    """Feeds a public batch from a shuffled DataLoader iterator into the loss (its first batch draws the
    shuffle's seed from torch's global generator, as dropout does), scales it by an ``itertools.count``, a
    generator warmup and a generator of random factors held in a dict; records each public batch's first
    value it used."""

    def __init__(self) -> None:
        super().__init__(n=256, batch_size=16)
        self.public = iter(DataLoader(PUBLIC, batch_size=8, shuffle=True))
        self.count = itertools.count(1)
        self.schedules = {"ramp": _ramp(), "jitter": _jitter()}
        self.used: list[float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        (public,) = next(self.public)
        self.used.append(float(public[0, 0]))
        weight = (
            min(1.0, next(self.count) / 10) * next(self.schedules["ramp"]) * next(self.schedules["jitter"])
        )
        shifted = F.dropout(x + 0.5 * public.mean(0) + self.reference, 0.2)
        return F.cross_entropy(self(shifted), y) * weight


def test_public_iterators_and_generators_give_every_pass_and_the_real_step_the_same_items():
    """Not refused (pass B gets pass A's public batch and warmup value), and the program draws the same
    items in the same order as with the checks off: the items after the fit are the same too."""
    runs = []
    for setting in (False, True, "every_step"):
        callback = PublicReference()
        module, _, strategy = _fit(PublicItems, setting, [callback])
        after = (
            float(next(module.public)[0][0, 0]),
            next(module.count),
            next(module.schedules["ramp"]),
            next(module.schedules["jitter"]),
            float(next(callback.public)[0][0, 0]),
        )
        runs.append((module, strategy, after))
    off, _, off_after = runs[0]
    assert len(off.used) == off.trainer.global_step
    for module, strategy, after in runs[1:]:
        assert strategy.checks.mixing.checked_steps
        assert module.used == off.used
        assert after == off_after
        _assert_same_weights(off, module)
    assert isinstance(runs[2][0].public, ReplayingIterator)  # the attribute the checks left behind


def test_a_replaying_iterator_replays_what_a_dry_pass_drew_then_continues():
    """PythonState's contract, directly: an iterator in an attribute, a list and a dict is replaced by one
    proxy; items drawn in a dry pass come back after restore; outside the passes nothing is kept."""
    from lightning_dp.checks.dry_flag import _dry

    module = TinyModule(n=16)
    shared = iter(range(100))
    module.stream = shared
    module.streams = [shared, (c for c in "abcdef")]
    saved = PythonState.save(module)
    assert isinstance(module.stream, ReplayingIterator)
    assert module.stream is module.streams[0]
    with _dry():
        drawn = [next(module.stream) for _ in range(3)], next(module.streams[1])
        module.stream = iter([])  # a pass that rebinds the attribute: put back
    saved.restore()
    with _dry():
        assert ([next(module.stream) for _ in range(3)], next(module.streams[1])) == drawn
    saved.restore()
    assert [next(module.stream) for _ in range(5)] == [0, 1, 2, 3, 4]  # replayed, then the iterator's own
    assert next(iter(module.streams[1])) == "a"
    assert module.stream._items == []  # handed to a real step: forgotten
