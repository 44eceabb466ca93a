"""The bad-input matrix: every invalid or dangerous configuration, and the exact text a user sees.

Each row names the problem and checks that the message names the fix. Rows that must *not* fail
(in-place activations, NaN examples) check that training goes on safely instead.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from conftest import TinyModule, make_trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, TensorDataset

from lightning_dp import ConstantNoise, DPConfigurationError, DPStrategy, FlatClipping, Poisson
from lightning_dp.accounting import PrivacyEvent
from tests.engine.test_runtime_checks import (
    TimeMajorTagger,
    TwoLoaders,
    TwoOptimizers,
    sequence_first_subclass,
)


@dataclass
class Row:
    name: str
    run: Callable[[object], object]
    message: str
    error: type[BaseException] = DPConfigurationError


def fit(strategy: DPStrategy, module: TinyModule | None = None, **trainer_kwargs) -> None:
    make_trainer(strategy, **trainer_kwargs).fit(module if module is not None else TinyModule())


class WithBatchNorm(TinyModule):
    def __init__(self, affine: bool = True):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(10, 16), nn.BatchNorm1d(16, affine=affine), nn.Tanh(), nn.Linear(16, 3)
        )


class DirectParameter(TinyModule):
    """A scale on the LightningModule itself multiplying the batch's mean loss (its gradient is that mean);
    ``self.net(x) * self.scale``, per example, trains (tests/test_model_patterns.py)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y) * self.scale


class Stream(IterableDataset):
    def __iter__(self):
        yield from zip(torch.randn(8, 10), torch.zeros(8, dtype=torch.long))


class Streaming(TinyModule):
    def train_dataloader(self):
        return DataLoader(Stream(), batch_size=4)


class CustomBatchSampler(TinyModule):
    def train_dataloader(self):
        data = TensorDataset(self.x, self.y)
        return DataLoader(
            data, batch_sampler=BatchSampler(RandomSampler(data), batch_size=8, drop_last=False)
        )


class Empty(TinyModule):
    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.zeros(0, 10), torch.zeros(0, dtype=torch.long)), batch_size=4)


class BufferedLayer(nn.Module):
    """A trainable layer with a running buffer and no per-example formula (like a custom norm)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(10))
        self.register_buffer("running", torch.zeros(10))

    def forward(self, x):
        self.running = 0.9 * self.running + 0.1 * x.detach().mean(0)
        return x * self.weight - self.running


class WithBufferedLayer(TinyModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(BufferedLayer(), nn.Linear(10, 3))


class Manual(TinyModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(nn.functional.cross_entropy(self(batch[0]), batch[1]))
        opt.step()


def resume(first: DPStrategy, second: DPStrategy, tmp_path, first_module=None, second_module=None) -> None:
    trainer = make_trainer(first, tmp_path, max_steps=2, max_epochs=5)
    trainer.fit(first_module or TinyModule(n=256))
    ckpt = tmp_path / "run.ckpt"
    trainer.save_checkpoint(ckpt)
    make_trainer(second, tmp_path, max_steps=4, max_epochs=5).fit(
        second_module or TinyModule(n=256), ckpt_path=ckpt
    )


def resume_edited(tmp_path, edit: Callable[[dict], object]) -> None:
    """Resume from a two-step DP checkpoint after ``edit`` changed its saved entries in place."""
    trainer = make_trainer(DPStrategy(noise_multiplier=1.0), tmp_path, max_steps=2, max_epochs=5)
    trainer.fit(TinyModule(n=256))
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    checkpoint = torch.load(tmp_path / "run.ckpt", weights_only=True)
    edit(checkpoint)
    torch.save(checkpoint, tmp_path / "edited.ckpt")
    make_trainer(DPStrategy(noise_multiplier=1.0), tmp_path, max_steps=4, max_epochs=5).fit(
        TinyModule(n=256), ckpt_path=tmp_path / "edited.ckpt"
    )


def lower_ledger_count(checkpoint: dict) -> None:
    for state in (checkpoint["lightning_dp"], *checkpoint["lightning_dp"]["ranks"]):
        state["ledger"]["history"][0]["count"] = 1


def empty_ledger(checkpoint: dict) -> None:
    for state in (checkpoint["lightning_dp"], *checkpoint["lightning_dp"]["ranks"]):
        state["ledger"]["history"] = []
        state["ledger_events"] = 0


def drop_ledger(checkpoint: dict) -> None:
    for state in (checkpoint["lightning_dp"], *checkpoint["lightning_dp"]["ranks"]):
        del state["ledger"]


def drop_ledger_history(checkpoint: dict) -> None:
    for state in (checkpoint["lightning_dp"], *checkpoint["lightning_dp"]["ranks"]):
        state["ledger"].pop("history", None)  # the entries may share one ledger dict


def resume_from_folder(tmp_path) -> None:
    (tmp_path / "checkpoints").mkdir()
    make_trainer(DPStrategy(noise_multiplier=1.0)).fit(TinyModule(), ckpt_path=tmp_path / "checkpoints")


def resume_from_plain(tmp_path) -> None:
    plain = make_trainer(SingleDeviceStrategy("cpu"), tmp_path, max_steps=1)
    plain.fit(TinyModule())
    plain.save_checkpoint(tmp_path / "plain.ckpt")
    make_trainer(DPStrategy(noise_multiplier=1.0), tmp_path, max_steps=2).fit(
        TinyModule(), ckpt_path=tmp_path / "plain.ckpt"
    )


@dataclass(frozen=True)
class RdpOnly(PrivacyEvent, kind="test_bad_inputs_rdp_only"):
    """An event with an RDP curve but no PRV form: the PRV accountant cannot price it."""

    noise_multiplier: float

    def rdp(self, orders):
        return np.asarray(orders) / (2 * self.noise_multiplier**2)


class RdpOnlySampler(Poisson):
    def event(self, noise_multiplier):
        return RdpOnly(noise_multiplier=noise_multiplier)


def scaler_plugin() -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


ROWS = [
    Row("epsilon zero", lambda _: DPStrategy(target_epsilon=0.0), "target_epsilon must be > 0, got 0.0."),
    Row(
        "epsilon negative", lambda _: DPStrategy(target_epsilon=-1.0), "target_epsilon must be > 0, got -1.0."
    ),
    Row("delta zero", lambda _: DPStrategy(delta=0.0), "delta must be in (0, 1), got 0.0"),
    Row("delta one", lambda _: DPStrategy(delta=1.0), "delta must be in (0, 1), got 1.0"),
    Row("delta negative", lambda _: DPStrategy(delta=-1e-5), "delta must be in (0, 1), got -1e-05"),
    Row(
        "clip zero",
        lambda _: DPStrategy(max_grad_norm=0.0),
        "DPStrategy: max_grad_norm must be > 0, got 0.0. Pass a value in that range. It is the clipping bound C.",
    ),
    Row(
        "clip negative",
        lambda _: DPStrategy(max_grad_norm=-1.0),
        "max_grad_norm must be > 0, got -1.0",
    ),
    Row(
        "sigma negative",
        lambda _: DPStrategy(noise_multiplier=-0.5),
        "noise_multiplier must be ≥ 0, got -0.5.",
    ),
    Row(
        "sigma NaN",
        lambda _: DPStrategy(noise_multiplier=math.nan),
        "noise_multiplier must be a number ≥ 0, got nan. NaN and infinity are refused: pass a finite value.",
    ),
    Row(
        "epsilon as a string",
        lambda _: DPStrategy(target_epsilon="3"),
        "DPStrategy: target_epsilon must be a number > 0, got '3' (str). Pass it as a number (target_epsilon=3), "
        "not a string.",
    ),
    Row(
        "delta as a bool",
        lambda _: DPStrategy(delta=True),
        "DPStrategy: delta must be a number in (0, 1), got True (bool).",
    ),
    Row(
        "infinite clip with noise",
        lambda _: DPStrategy(max_grad_norm=math.inf, noise_multiplier=1.0),
        "max_grad_norm=inf with noise: the noise's standard deviation is σ·C, so an unbounded C turns every "
        "weight into NaN",
    ),
    Row(
        "infinite clip with a target",
        lambda _: DPStrategy(max_grad_norm=math.inf, target_epsilon=1.0),
        "C=inf is accepted only with noise_multiplier=0 (no privacy)",
    ),
    Row(
        "infinite sigma",
        lambda _: DPStrategy(noise_multiplier=math.inf),
        "noise_multiplier must be a number ≥ 0, got inf",
    ),
    Row(
        "physical batch not an integer",
        lambda _: DPStrategy(max_physical_batch_size=2.5),
        "max_physical_batch_size must be an integer ≥ 1 or None, got 2.5 (float)",
    ),
    Row(
        "seed as a string",
        lambda _: DPStrategy(seed="1"),
        "DPStrategy: seed must be an integer, got '1' (str)",
    ),
    Row(
        "unknown accountant",
        lambda _: DPStrategy(accountant="gdp"),
        "accountant must be 'rdp', 'prv', 'pld' or 'pure', got 'gdp'.",
    ),
    Row(
        "bad loss reduction",
        lambda _: DPStrategy(loss_reduction="none"),
        "loss_reduction must be 'mean' or 'sum'",
    ),
    Row(
        "physical batch < 1",
        lambda _: DPStrategy(max_physical_batch_size=0),
        "max_physical_batch_size must be ≥ 1",
    ),
    Row(
        "noise twice",
        lambda _: DPStrategy(noise=ConstantNoise(1.0), noise_multiplier=1.0),
        "Give either noise=... or noise_multiplier=..., not both.",
    ),
    Row(
        "batch larger than data (q > 1)",
        lambda _: fit(DPStrategy(noise_multiplier=1.0), TinyModule(n=16, batch_size=32)),
        "The expected batch size (32) is larger than the training set (16)",
    ),
    Row(
        "empty dataset", lambda _: fit(DPStrategy(noise_multiplier=1.0), Empty()), "The training set is empty"
    ),
    Row(
        "IterableDataset",
        lambda _: fit(DPStrategy(noise_multiplier=1.0), Streaming()),
        "The train dataset is an IterableDataset",
    ),
    Row(
        "custom batch_sampler",
        lambda _: fit(DPStrategy(noise_multiplier=1.0), CustomBatchSampler()),
        "The train DataLoader has no batch_size",
    ),
    Row(
        "BatchNorm in train mode",
        lambda _: fit(DPStrategy(noise_multiplier=1.0), WithBatchNorm()),
        "The BatchNorm layers ['net.1'] normalised this step's batch with its own statistics (train mode, or "
        "track_running_stats=False): each example's output depends on the other examples of the batch",
    ),
    Row(
        "BatchNorm affine=False in train mode",
        lambda _: fit(DPStrategy(noise_multiplier=1.0), WithBatchNorm(affine=False)),
        "Freeze them in eval mode",
    ),
    Row(
        "layer with buffers and no formula",
        lambda _: fit(DPStrategy(noise_multiplier=1.0), WithBufferedLayer()),
        "buffers ['net.0.running'] were written from the batch in the forward",
    ),
    Row(
        "a parameter on the LightningModule times the batch's mean loss",
        lambda _: fit(DPStrategy(noise_multiplier=1.0), DirectParameter()),
        "A trainable parameter is used outside the forward of its layer (mul on ['scale'])",
    ),
    Row(
        "gradient_clip_val",
        lambda _: fit(DPStrategy(noise_multiplier=1.0), gradient_clip_val=1.0),
        "Trainer(gradient_clip_val=1.0) clips the aggregated gradient, which is not per-example clipping",
    ),
    Row(
        "accumulate_grad_batches",
        lambda _: fit(DPStrategy(noise_multiplier=1.0), accumulate_grad_batches=2),
        "Trainer(accumulate_grad_batches=2) breaks DP-SGD",
    ),
    Row(
        "fp16 with a GradScaler",
        lambda _: fit(DPStrategy(noise_multiplier=1.0, precision_plugin=scaler_plugin())),
        "precision='16-mixed' uses a GradScaler",
    ),
    Row(
        "target the planned steps cannot reach",
        lambda _: fit(DPStrategy(target_epsilon=1e-4, delta=1e-10), max_epochs=1000),
        "target_epsilon=0.0001 cannot be met",
    ),
    Row(
        "no training horizon for a target",
        lambda _: fit(DPStrategy(target_epsilon=1.0), max_epochs=-1, max_steps=-1),
        "Calibrating σ from target_epsilon needs a finite training length",
    ),
    Row(
        "virtual batching with manual optimization",
        lambda _: fit(DPStrategy(noise_multiplier=1.0, max_physical_batch_size=4), Manual()),
        "max_physical_batch_size needs automatic optimization",
    ),
    Row(
        "several train loaders",
        lambda _: fit(DPStrategy(noise_multiplier=1.0), TwoLoaders()),
        "train_dataloader returned several loaders",
    ),
    Row(
        "time-major batch dimension",
        lambda _: fit(DPStrategy(noise_multiplier=1.0), TimeMajorTagger()),
        "rows on its batch dimension (dim 0) than this batch has examples",
    ),
    Row(
        "sequence-first LSTM subclass",
        lambda _: fit(DPStrategy(noise_multiplier=1.0), sequence_first_subclass()),
        "Layer 'lstm' (MyLSTM) is built with batch_first=False",
    ),
    Row(
        "two releases from one batch",
        lambda _: fit(DPStrategy(noise_multiplier=1.0), TwoOptimizers(alternate=False)),
        "Use one optimizer over all parameters",
    ),
    Row(
        "more than one device",
        lambda _: fit(DPStrategy(noise_multiplier=1.0), devices=2),
        "DPStrategy trains on one device, but the Trainer asked for 2",
    ),
    Row(
        "unpriceable mechanism combination",
        lambda _: fit(DPStrategy(noise_multiplier=1.0, accountant="prv", sampler=RdpOnlySampler())),
        "the PRV accountant cannot price 'test_bad_inputs_rdp_only' events (RdpOnly(noise_multiplier=1.0)); "
        "use accountant='rdp'",
        ValueError,
    ),
    Row("resume without privacy state", resume_from_plain, "has no privacy state"),
    Row(
        "resume with another data set size",
        lambda tmp: resume(
            DPStrategy(noise_multiplier=1.0),
            DPStrategy(noise_multiplier=1.0),
            tmp,
            second_module=TinyModule(n=300),
        ),
        "The checkpoint was trained on N=256 with sample rate 0.125; this run has N=300",
    ),
    Row(
        "resume with a shrunk data set",
        lambda tmp: resume(
            DPStrategy(noise_multiplier=1.0),
            DPStrategy(noise_multiplier=1.0),
            tmp,
            second_module=TinyModule(n=200),
        ),
        "the training set shrank from 256 to 200 examples (by 56), which changed q from 0.125 to 0.16. Resume "
        "with the same training set and batch_size",
    ),
    Row(
        "not one step affordable",
        lambda _: fit(DPStrategy(noise_multiplier=0.5, target_epsilon=0.05), TinyModule(n=200)),
        "Not even one step fits in target_epsilon=0.05 at noise multiplier 0.5 and sample rate q=0.16 "
        "(expected batch 32 of N=200 examples). Raise the noise multiplier or the budget, or lower q",
    ),
    Row(
        "resume with another mechanism",
        lambda tmp: resume(
            DPStrategy(noise_multiplier=1.0),
            DPStrategy(noise_multiplier=1.0, clipping=type("OtherClipping", (FlatClipping,), {})()),
            tmp,
        ),
        "The checkpoint was trained with clipping=FlatClipping, this run uses OtherClipping",
    ),
    Row(
        "resume with a lowered ledger count",
        lambda tmp: resume_edited(tmp, lower_ledger_count),
        "does not add up: its ledger holds 1 events but was saved holding 2; its ledger holds 1 events for 2 "
        "private steps (at least one each). It was edited or written by something else",
    ),
    Row(
        "resume with an emptied ledger",
        lambda tmp: resume_edited(tmp, empty_ledger),
        "its ledger holds 0 events for 2 private steps (at least one each)",
    ),
    Row(
        "resume with the ledger removed",
        lambda tmp: resume_edited(tmp, drop_ledger),
        "has an incomplete privacy state: ledger missing.",
    ),
    Row(
        "resume with the ledger's history removed",
        lambda tmp: resume_edited(tmp, drop_ledger_history),
        "has an incomplete privacy state: ledger.history missing. It was edited, or written by something other "
        "than DPStrategy",
    ),
    Row("resume from a folder", resume_from_folder, "is a folder, not a checkpoint file. Pass one file"),
    Row(
        "resume with another delta",
        lambda tmp: resume(
            DPStrategy(noise_multiplier=1.0), DPStrategy(noise_multiplier=1.0, delta=1e-6), tmp
        ),
        "delta",
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_bad_input_is_refused_with_a_message_that_names_the_fix(row: Row, tmp_path):
    with pytest.raises(row.error) as info:
        row.run(tmp_path)
    assert row.message in " ".join(str(info.value).split()), str(info.value)


def test_matrix_has_at_least_25_rows():
    assert len(ROWS) >= 25


def test_delta_not_below_one_over_n_warns():
    with pytest.warns(UserWarning, match=r"delta=0.01 is not below 1/N = 0.00391"):
        fit(DPStrategy(noise_multiplier=1.0, delta=0.01), TinyModule(n=256), max_steps=1)


def test_zero_noise_warns_that_there_is_no_privacy():
    with pytest.warns(UserWarning, match="adds no noise: this run has no privacy"):
        DPStrategy(noise_multiplier=0.0)


def test_nan_examples_are_dropped_and_still_charged():
    """An example whose loss or gradient is NaN contributes nothing; the step is still priced."""
    module = TinyModule(n=64, batch_size=64)
    module.x[3] = math.nan
    module.x[10] = math.inf
    strategy = DPStrategy(noise_multiplier=1.0, seed=0)
    fit(strategy, module, max_epochs=2)
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert strategy.engine.steps == 2
    assert strategy.ledger.steps == 2


def test_in_place_activations_train():
    class InPlace(TinyModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(10, 16), nn.ReLU(inplace=True), nn.Linear(16, 3))

    module = InPlace()
    before = [p.detach().clone() for p in module.parameters()]
    fit(DPStrategy(noise_multiplier=0.5), module, max_steps=2)
    assert not torch.equal(before[0], next(module.parameters()))


def _numeric_and_flag_arguments() -> list[tuple[type, dict, str, str]]:
    """(class, required kwargs, argument, 'number' or 'flag') for every typed argument of the public constructors."""
    import inspect

    from lightning_dp import (
        DPIS,
        AdaCliP,
        AdaptiveGD,
        Checks,
        ConstantNoise,
        DPDDPStrategy,
        FixedSize,
        HeavyBall,
        LineSearch,
        Nesterov,
        NoiseDividing,
        PrivacyCallback,
        UserPoisson,
    )
    from lightning_dp.steps.dp_accelerated import MultiStageNesterov
    from lightning_dp.strategies.deprecated import KEYWORDS
    from lightning_dp.strategies.options import UserBound

    required: dict[type, dict] = {
        AdaCliP: {"h2": 1.0},
        Nesterov: {"momentum": 0.5},
        MultiStageNesterov: {"lr": 0.1, "mu": 0.1, "L": 1.0},
        UserBound: {"user_key": "user", "max_examples_per_user": 1},
    }
    classes = [DPStrategy, DPDDPStrategy, Poisson, FixedSize, DPIS, AdaCliP, ConstantNoise, NoiseDividing]
    classes += [HeavyBall, Nesterov, MultiStageNesterov, LineSearch, AdaptiveGD, PrivacyCallback]
    classes += [Checks, UserPoisson, UserBound]  # the options objects; their deprecated keywords are theirs
    out = []
    for cls in classes:
        for name, parameter in inspect.signature(cls).parameters.items():
            annotation = str(parameter.annotation)
            kind = (
                "flag"
                if annotation == "bool"
                else "number"
                if {"float", "int"} & set(annotation.split())
                else None
            )
            if kind == "flag" and cls in (DPStrategy, DPDDPStrategy):
                continue  # a strategy's switches are Lightning's; its numbers are all checked
            if name in KEYWORDS and cls in (DPStrategy, DPDDPStrategy):
                continue  # a deprecated keyword: checked as the field of Checks or UserPoisson it becomes
            if kind is not None:
                out.append((cls, required.get(cls, {}), name, kind))
    return out


ARGUMENTS = _numeric_and_flag_arguments()


@pytest.mark.parametrize(
    ("cls", "required", "name", "kind"), ARGUMENTS, ids=[f"{c.__name__}.{n}" for c, _, n, _ in ARGUMENTS]
)
def test_every_numeric_argument_refuses_a_string_naming_itself(cls, required, name, kind):
    """'3' for a number (or 'no' for a switch) is refused at construction with the class and argument named."""
    from lightning_dp.core.validation import ArgumentError

    value = "no" if kind == "flag" else "3"
    with pytest.raises(ArgumentError, match=f"^{cls.__name__}: {name} must be ") as info:
        cls(**{**required, name: value})
    assert isinstance(info.value, DPConfigurationError)
    assert isinstance(info.value, ValueError)


def test_argument_list_covers_every_slot_constructor():
    covered = {cls.__name__ for cls, _, _, _ in ARGUMENTS}
    assert len(ARGUMENTS) >= 60
    assert {"DPIS", "AdaCliP", "LineSearch", "AdaptiveGD", "MultiStageNesterov", "PrivacyCallback"} <= covered


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: DPStrategy(noise_multiplier=1.0, max_grad_norm=math.nan),
            "max_grad_norm must be a number > 0, got nan",
        ),
        (lambda: ConstantNoise(math.inf), "ConstantNoise: noise_multiplier must be a number ≥ 0, got inf"),
        (lambda: Poisson(seed=1.5), "Poisson: seed must be an integer or None, got 1.5 (float)"),
    ],
)
def test_non_finite_and_non_integer_values_are_refused(make, message):
    with pytest.raises(DPConfigurationError) as info:
        make()
    assert message in str(info.value)


def test_infinite_clip_without_noise_is_accepted():
    """C = ∞ with σ = 0 is a non-private debugging run (already warned about), not NaN weights."""
    with pytest.warns(UserWarning, match="adds no noise"):
        strategy = DPStrategy(noise_multiplier=0.0, max_grad_norm=math.inf)
    fit(strategy, max_steps=2)
    assert strategy.engine.steps == 2


class WithValidation(TinyModule):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", nn.functional.cross_entropy(self(batch[0]), batch[1]))

    def val_dataloader(self):
        return DataLoader(TensorDataset(self.x[:64], self.y[:64]), batch_size=64)


@pytest.mark.parametrize(
    ("callback", "named"),
    [
        (lambda: EarlyStopping(monitor="train_loss", patience=100), "EarlyStopping(monitor='train_loss')"),
        (lambda: ModelCheckpoint(monitor="train_loss"), "ModelCheckpoint(monitor='train_loss')"),
    ],
    ids=["EarlyStopping", "ModelCheckpoint"],
)
def test_monitoring_a_training_metric_warns_that_the_stop_is_not_private(callback, named, tmp_path):
    with pytest.warns(UserWarning, match="watches a metric logged during training") as record:
        fit(
            DPStrategy(noise_multiplier=1.0),
            WithValidation(),
            max_epochs=2,
            callbacks=[callback()],
            enable_checkpointing=True,
            default_root_dir=str(tmp_path),
        )
    assert sum("logged during training" in str(w.message) for w in record) == 1
    assert named in next(str(w.message) for w in record if "logged during training" in str(w.message))


def test_monitoring_a_validation_metric_does_not_warn(tmp_path):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*logged during training.*")
        fit(
            DPStrategy(noise_multiplier=1.0),
            WithValidation(),
            max_epochs=2,
            callbacks=[EarlyStopping(monitor="val_loss"), ModelCheckpoint(monitor="val_loss")],
            enable_checkpointing=True,
            default_root_dir=str(tmp_path),
        )
