"""Ordinary Lightning paths keep the ledger true (issue #29, items 2, 3, 4, 7 and 9): tuners, a ledger that
only grows, data that changes between epochs, schedulers and callbacks that watch a training metric,
checkpoints of steps that release nothing, edited checkpoints, and a clean first run of the command."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import TinyModule, make_trainer
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder
from lightning.pytorch.tuner import Tuner
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from lightning_dp import DPConfigurationError, DPStrategy
from lightning_dp.accounting import PoissonGaussian, PrivacyLedger, compute_epsilon

ROOT = Path(__file__).resolve().parents[1]
N, BATCH = 64, 16


class Tunable(TinyModule):
    """TinyModule with the attributes Lightning's tuners adjust."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.learning_rate = self.lr


# -- item 2: tuners and a ledger that only grows ---------------------------------------------------------
@pytest.mark.parametrize(
    "tune",
    [
        lambda trainer, model: Tuner(trainer).lr_find(model, num_training=16),
        lambda trainer, model: trainer.fit(model),  # with LearningRateFinder in the callbacks
        lambda trainer, model: Tuner(trainer).scale_batch_size(model, max_trials=2),
        lambda trainer, model: trainer.fit(model, train_dataloaders=None),  # with BatchSizeFinder
    ],
    ids=["Tuner.lr_find", "LearningRateFinder", "Tuner.scale_batch_size", "BatchSizeFinder"],
)
def test_tuners_are_refused_before_their_first_release(tune, request, tmp_path):
    callbacks = {
        "LearningRateFinder": [LearningRateFinder()],
        "BatchSizeFinder": [BatchSizeFinder(max_trials=2)],
    }
    strategy = DPStrategy(noise_multiplier=1.0)
    trainer = make_trainer(
        strategy, tmp_path, max_epochs=2, callbacks=callbacks.get(request.node.callspec.id, [])
    )
    with pytest.raises(DPConfigurationError, match="then restores the initial weights") as info:
        tune(trainer, Tunable(n=N, batch_size=BATCH))
    assert "`lightning-dp tune` (docs/tuning.md)" in str(info.value)
    assert "several loaders" not in str(info.value)
    assert strategy.engine.steps == strategy.ledger.steps == 0


def test_a_restore_never_lowers_the_ledger(tmp_path):
    """The same strategy, after more private steps, restoring an earlier checkpoint: refused, ε unchanged."""
    strategy, model = DPStrategy(noise_multiplier=1.0), TinyModule(n=N, batch_size=BATCH)
    trainer = make_trainer(strategy, tmp_path, max_steps=2, max_epochs=5)
    trainer.fit(model)
    trainer.save_checkpoint(tmp_path / "early.ckpt")
    trainer.fit_loop.epoch_loop.max_steps = 5
    trainer.fit(model)  # three more steps
    spent = (strategy.ledger.steps, strategy.epsilon)
    assert spent[0] == 5
    trainer.fit_loop.epoch_loop.max_steps = 6
    with pytest.raises(DPConfigurationError, match="would lower this strategy's privacy ledger"):
        trainer.fit(model, ckpt_path=tmp_path / "early.ckpt")
    assert (strategy.ledger.steps, strategy.epsilon) == spent


def test_the_ledger_loads_only_states_that_continue_it():
    a, b = PoissonGaussian(1.0, 0.1), PoissonGaussian(2.0, 0.1)
    ledger = PrivacyLedger(1e-5)
    ledger.record(a, 3)
    earlier = ledger.state_dict()
    ledger.record(b, 2)
    later = PrivacyLedger(1e-5)
    later.load_state_dict(ledger.state_dict())
    later.record(b)
    ledger.load_state_dict(later.state_dict())  # continues it: 3 a, 3 b
    assert ledger.history == [(a, 3), (b, 3)]
    before = ledger.epsilon()
    with pytest.raises(ValueError, match="does not continue this one"):
        ledger.load_state_dict(earlier)
    other = PrivacyLedger(1e-5)
    other.record(b, 10)
    with pytest.raises(ValueError, match="a ledger only grows"):  # more ε, but not these releases
        ledger.load_state_dict(other.state_dict())
    assert ledger.history == [(a, 3), (b, 3)]
    assert ledger.epsilon() == before


# -- item 3: the training set may not change between epochs ---------------------------------------------------
class Curriculum(TinyModule):
    """Reloaded every epoch (``reload_dataloaders_every_n_epochs=1``); ``change`` picks what epoch 1 returns."""

    def __init__(self, change: str) -> None:
        super().__init__(n=N, batch_size=BATCH)
        self.change = change
        self.data = TensorDataset(self.x, self.y)

    def train_dataloader(self):
        if self.current_epoch == 0 or self.change == "same object":
            return DataLoader(self.data, batch_size=BATCH)
        if self.change == "equal copy":  # new objects, same contents
            return DataLoader(
                Subset(TensorDataset(self.x.clone(), self.y.clone()), range(N)), batch_size=BATCH
            )
        if self.change == "subset":  # a self-paced curriculum: the examples with the lowest loss
            with torch.no_grad():
                losses = nn.functional.cross_entropy(self(self.x), self.y, reduction="none")
            return DataLoader(Subset(self.data, losses.argsort()[: N // 2].tolist()), batch_size=BATCH)
        if self.change == "same size":
            return DataLoader(TensorDataset(self.x.flip(0), self.y), batch_size=BATCH)
        assert self.change == "batch size"
        return DataLoader(self.data, batch_size=BATCH // 2)

    def wrap_dataset(self) -> None:
        """Epoch 0 already wrapped in a Subset, so that the equal copy is of the same type."""
        self.data = Subset(self.data, range(N))


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ("subset", "the training set went from N=64 to N=32 examples"),
        ("same size", "a different data set of the same size (N=64)"),
        ("batch size", "batch_size changed q from 0.25 to 0.125"),
    ],
)
def test_a_train_set_that_changes_between_epochs_is_refused(change, said):
    strategy, model = DPStrategy(noise_multiplier=1.0), Curriculum(change)
    trainer = make_trainer(strategy, max_epochs=3, reload_dataloaders_every_n_epochs=1)
    with pytest.raises(DPConfigurationError, match="The train loader changed during the run") as info:
        trainer.fit(model)
    assert said in str(info.value)
    assert "data_changes='public'" in str(info.value)
    assert strategy.engine.steps == strategy.ledger.steps == 4  # epoch 0 only: nothing from the new data


@pytest.mark.parametrize("change", ["same object", "equal copy"])
def test_reloading_the_same_data_keeps_working(change):
    strategy, model = DPStrategy(noise_multiplier=1.0), Curriculum(change)
    model.wrap_dataset()
    make_trainer(strategy, max_epochs=3, reload_dataloaders_every_n_epochs=1).fit(model)
    assert strategy.engine.steps == 12
    assert strategy.ledger.history == [(PoissonGaussian(1.0, BATCH / N), 12)]


def test_declared_public_data_changes_are_priced_as_they_come():
    strategy, model = DPStrategy(noise_multiplier=1.0, data_changes="public"), Curriculum("batch size")
    make_trainer(strategy, max_epochs=2, reload_dataloaders_every_n_epochs=1).fit(model)
    assert strategy.ledger.history == [(PoissonGaussian(1.0, 0.25), 4), (PoissonGaussian(1.0, 0.125), 8)]


def test_data_changes_is_validated():
    with pytest.raises(DPConfigurationError, match="data_changes must be 'refuse' or 'public'"):
        DPStrategy(data_changes="allow")  # type: ignore[arg-type]


# -- item 4: schedulers and callbacks that watch a training metric -----------------------------------------------
class Plateau(TinyModule):
    def __init__(self, monitor: str) -> None:
        super().__init__(n=N, batch_size=BATCH)
        self.monitor = monitor

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", nn.functional.cross_entropy(self(batch[0]), batch[1]))

    def val_dataloader(self):
        return DataLoader(TensorDataset(self.x[:16], self.y[:16]), batch_size=16)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": self.monitor}}


class Watcher(Callback):
    """A user's own callback that acts on a metric, the way EarlyStopping does."""

    def __init__(self, monitor: str) -> None:
        self.monitor = monitor


def fit_watched(model: TinyModule, callbacks: list[Callback]) -> list[str]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        make_trainer(DPStrategy(noise_multiplier=1.0), max_epochs=2, callbacks=callbacks).fit(model)
    return [str(w.message) for w in record if "watches a metric logged during training" in str(w.message)]


@pytest.mark.parametrize(
    ("model", "callbacks", "named"),
    [
        (lambda: Plateau("train_loss"), [], "ReduceLROnPlateau(monitor='train_loss')"),
        (lambda: Plateau("val_loss"), [Watcher("train_loss")], "Watcher(monitor='train_loss')"),
    ],
    ids=["ReduceLROnPlateau", "custom callback"],
)
def test_schedulers_and_callbacks_watching_a_training_metric_warn_like_early_stopping(
    model, callbacks, named
):
    messages = fit_watched(model(), callbacks)
    assert len(messages) == 1
    assert messages[0].startswith(named)
    assert "how the learning rate changes" in messages[0]


def test_watching_a_validation_metric_is_silent():
    assert fit_watched(Plateau("val_loss"), [Watcher("val_loss")]) == []


# -- item 7: a run's own checkpoints resume; edited ones are refused ---------------------------------------------
def save_and_resume(strategy: DPStrategy, make_model, tmp_path, more: dict, **first) -> DPStrategy:
    """Fit ``strategy`` with the Trainer settings ``first``, checkpoint, resume with ``more`` in a new strategy."""
    trainer = make_trainer(strategy, tmp_path, **first)
    trainer.fit(make_model())
    trainer.save_checkpoint(tmp_path / "own.ckpt")
    config = strategy.config
    resumed = DPStrategy(noise_multiplier=config.noise_multiplier, target_epsilon=config.target_epsilon)
    make_trainer(resumed, tmp_path, **more).fit(make_model(), ckpt_path=tmp_path / "own.ckpt")
    return resumed


def test_steps_forced_past_the_budget_still_resume(tmp_path):
    target = compute_epsilon(noise_multiplier=1.0, sample_rate=BATCH / N, steps=3, delta=1e-5) + 1e-9
    strategy = DPStrategy(noise_multiplier=1.0, target_epsilon=target)
    resumed = save_and_resume(
        strategy, lambda: TinyModule(n=N, batch_size=BATCH), tmp_path, dict(max_steps=45, max_epochs=20),
        max_steps=40, min_steps=40, max_epochs=20,
    )  # fmt: skip
    assert (strategy.engine.steps, strategy.step_counts.silent_steps) == (3, 37)
    assert (resumed.engine.steps, resumed.epsilon) == (3, strategy.epsilon)


class Manual(TinyModule):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(nn.functional.cross_entropy(self(batch[0]), batch[1]))
        optimizer.step()


def test_manual_optimization_with_empty_batches_resumes(tmp_path):
    """An empty batch's noise-only release is not one of Lightning's optimizer steps under manual optimization."""
    strategy = DPStrategy(noise_multiplier=1.0, seed=1)
    resumed = save_and_resume(
        strategy, lambda: Manual(n=N, batch_size=1), tmp_path, dict(max_epochs=2), max_epochs=1
    )
    assert strategy.step_counts.steps_outside_loop > 0  # some of the 64 batches of expected size 1 were empty
    assert resumed.engine.steps == 2 * strategy.engine.steps


@pytest.fixture
def three_steps(tmp_path) -> Path:
    trainer = make_trainer(DPStrategy(noise_multiplier=1.0), tmp_path, max_steps=3, max_epochs=5)
    trainer.fit(TinyModule(n=N, batch_size=BATCH))
    trainer.save_checkpoint(tmp_path / "three.ckpt")
    return tmp_path / "three.ckpt"


def lower_counters_and_global_step(checkpoint: dict, state: dict) -> None:
    state["steps"] = state["ledger_events"] = state["ledger"]["history"][0]["count"] = 1
    checkpoint["global_step"] = 1


def set_event(key: str, value: float):
    def edit(checkpoint: dict, state: dict) -> None:
        state["ledger"]["history"][0]["event"][key] = value

    return edit


def set_saved_sigma(checkpoint: dict, state: dict) -> None:
    state["slots"]["noise"]["state"]["sigma"] = 2.0


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (lower_counters_and_global_step, "its global_step 1 is not the fit loop's 3 optimizer steps"),
        (set_event("noise_multiplier", 1.5), "its ledger holds 3 × PoissonGaussian(noise_multiplier=1.5"),
        (set_event("sample_rate", 0.125), "sample_rate=0.125), but the restored Poisson and ConstantNoise"),
        (set_saved_sigma, "its ledger holds 0 × PoissonGaussian(noise_multiplier=2.0, sample_rate=0.25)"),
    ],
    ids=["counters and global_step", "event sigma", "event q", "noise slot sigma"],
)
def test_an_edited_checkpoint_is_refused(three_steps, tmp_path, edit, said):
    checkpoint = torch.load(three_steps, weights_only=True)
    for state in (checkpoint["lightning_dp"], *checkpoint["lightning_dp"]["ranks"]):
        edit(checkpoint, state)
    torch.save(checkpoint, tmp_path / "edited.ckpt")
    model = TinyModule(n=N, batch_size=BATCH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the σ edit also warns that the checkpoint's σ is kept
        with pytest.raises(DPConfigurationError, match="does not add up") as info:
            make_trainer(DPStrategy(noise_multiplier=1.0), tmp_path, max_steps=5, max_epochs=5).fit(
                model, ckpt_path=tmp_path / "edited.ckpt"
            )
    assert said in str(info.value)
    assert model.seen_batch_sizes == []  # refused before the first batch


# -- item 9: the first run's output ------------------------------------------------------------------------------------
def run_python(code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_importing_lightning_dp_adds_no_root_logging_handler():
    out = run_python(
        "import logging, lightning_dp, opacus.utils.module_utils; "
        "logging.getLogger('lightning.pytorch').info('once'); print(len(logging.getLogger().handlers))"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"
    assert out.stderr.count("once") == 1


@pytest.mark.parametrize("users_handler", [False, True])
def test_opacus_is_imported_without_touching_a_users_root_handler(monkeypatch, users_handler):
    """The import again, in this process: Opacus's handler is taken back, the user's own is kept."""
    root = logging.getLogger()
    mine = logging.StreamHandler()
    monkeypatch.setattr(root, "handlers", [mine] if users_handler else [])
    import opacus.utils

    from lightning_dp.core._logging import import_opacus_quietly

    monkeypatch.setattr(opacus.utils, "module_utils", opacus.utils.module_utils)  # restored afterwards
    monkeypatch.delitem(sys.modules, "opacus.utils.module_utils")
    import_opacus_quietly()
    assert "opacus.utils.module_utils" in sys.modules  # imported, so its basicConfig ran
    assert root.handlers == ([mine] if users_handler else [])


@pytest.mark.slow
def test_the_command_prints_each_line_once_and_no_cli_warning(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable, "-m", "lightning_dp.commands.cli", "fit", "--config", str(ROOT / "configs" / "digits_dpsgd.yaml"),
        "--trainer.max_epochs", "1", "--trainer.logger.init_args.save_dir", str(tmp_path),
        "--trainer.enable_progress_bar", "false",
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "args parameter" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if "Seed set to" in line or "lightning-dp:" in line]
    assert lines
    assert len(lines) == len(set(lines)), lines
