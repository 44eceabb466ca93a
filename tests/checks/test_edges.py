"""Nothing escapes the checks at the step's edges (issue #47, items 1, 2, 3, 5, 7): writes after the optimizer
step, reduced precision, oversampling inside the batch, the refusal's words, and mixing that starts later.

Each case trains through the Trainer with the defaults a user gets (the check runs on the first batch of a
fit, of every epoch and after a change, and on random others), and is refused before the release it would
break; each control (ordinary code that reads no other example) trains.
"""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import make_trainer
from lightning.pytorch import Callback, LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy
from lightning_dp.checks.mixing_tolerance import _U32, FP32_EXAMPLE_ROUNDING, move_tolerance, summation_chunk
from lightning_dp.core.errors import DPConfigurationError

pytestmark = pytest.mark.filterwarnings("ignore")

AFTER_STEP = "were written after the optimizer step by"
MIXING = "Sensitivity check failed"


def data(n: int, seed: int = 0, minority: int = 0, outlier: bool = False) -> TensorDataset:
    """n examples of 4 features and 3 classes (``minority`` of them in class 2, the others in 0 and 1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    if outlier:
        x[int(torch.randint(n, (), generator=g)), 0] = 6.0
    y = torch.randint(0, 3 if not minority else 2, (n,), generator=g)
    if minority:
        y[torch.randperm(n, generator=g)[:minority]] = 2
    return TensorDataset(x, y)


class Classifier(LightningModule):
    """4 → 8 → 3 with a ReLU; a per-example loss (nothing mixes)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(torch.relu(self.l1(x)))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(module: LightningModule, dataset: TensorDataset, batch_size: int, **kwargs: Any) -> DPStrategy:
    settings = {"noise_multiplier": 0.0, "max_grad_norm": 0.1, "seed": 0, **kwargs.pop("dp", {})}
    strategy = DPStrategy(**settings)
    loader = DataLoader(dataset, batch_size=batch_size)
    make_trainer(strategy, **{"max_steps": 2, **kwargs}).fit(module, train_dataloaders=loader)
    return strategy


def refused(
    module: LightningModule, dataset: TensorDataset, batch_size: int, match: str, **kwargs: Any
) -> str:
    """The refusal's text; no release came before it."""
    strategy = DPStrategy(noise_multiplier=0.0, max_grad_norm=0.1, seed=0, **kwargs.pop("dp", {}))
    loader = DataLoader(dataset, batch_size=batch_size)
    with pytest.raises(DPConfigurationError, match=match) as refusal:
        make_trainer(strategy, **{"max_steps": 2, **kwargs}).fit(module, train_dataloaders=loader)
    assert strategy.engine.steps == 0
    return str(refusal.value)


# -- 1. writes after the optimizer step ---------------------------------------------------------------------


class ReDo(Classifier):
    """Dormant-unit reset (ReDo): units the batch left inactive get fresh weights. Unit 0 fires only on a
    large first feature (the outlier record): whether it is reset reads that record."""

    def __init__(self) -> None:
        super().__init__()
        with torch.no_grad():
            self.l1.weight[0] = torch.tensor([1.0, 0.0, 0.0, 0.0])
            self.l1.bias[0] = -3.0

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            dormant = torch.relu(self.l1(batch[0])).sum(0) == 0
            fresh = torch.empty_like(self.l1.weight)
            nn.init.kaiming_uniform_(fresh, a=math.sqrt(5))
            self.l1.weight[dormant] = fresh[dormant]
            self.l2.weight[:, dormant] = 0.0


class CodebookRestart(Callback):
    """VQ-VAE codebook restart: codes the batch did not use are replaced by the batch's encodings."""

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            z = module.l1(batch[0])
            used = torch.cdist(z, module.codebook.weight).argmin(1)
            dead = (torch.bincount(used, minlength=16) == 0).nonzero().squeeze(1)
            module.codebook.weight[dead] = z[torch.arange(len(dead)) % len(z)]


class VQ(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.codebook = nn.Embedding(16, 8)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        z = self.l1(x)
        codes = self.codebook(torch.cdist(z, self.codebook.weight).argmin(1))
        return F.cross_entropy(self.l2(z + (codes - z).detach()), y) + F.mse_loss(codes, z.detach())


def test_writes_after_the_step_that_read_the_batch_are_refused_before_any_release():
    message = refused(ReDo(), data(16, outlier=True), 16, AFTER_STEP)
    assert "ReDo.on_train_batch_end" in message
    assert "l1.weight" in message
    message = refused(VQ(), data(16), 16, AFTER_STEP, callbacks=[CodebookRestart()])
    assert "CodebookRestart.on_train_batch_end" in message
    assert "codebook.weight" in message


class EveryThirdStep(Classifier):
    """Writes the batch's mean into ``l2.bias`` after every third step only (by ``global_step``), or on every
    third ``batch_idx``: the checked first batch sees counters on which it writes nothing."""

    def __init__(self, by: str) -> None:
        super().__init__()
        self.by = by

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        counter = self.trainer.global_step if self.by == "global_step" else batch_idx
        if counter % 3 == 2:
            with torch.no_grad():
                self.l2.bias.copy_(batch[0].mean(0)[:3])


@pytest.mark.parametrize("by", ["global_step", "batch_idx"])
def test_a_write_from_the_batch_on_some_steps_only_is_refused_before_the_next_release(by):
    """Its first write makes the next batch a checked one, whose passes run the hooks on the previous step's
    counters too: refused then, before the release that would follow the leaked write."""
    strategy = DPStrategy(noise_multiplier=0.0, max_grad_norm=0.1, seed=0)
    loader = DataLoader(data(256), batch_size=16)
    with pytest.raises(DPConfigurationError, match=AFTER_STEP) as refusal:
        make_trainer(strategy, max_steps=12).fit(EveryThirdStep(by), train_dataloaders=loader)
    assert "EveryThirdStep.on_train_batch_end" in str(refusal.value)
    assert "'l2.bias'" in str(refusal.value)
    first_write = 1 if by == "global_step" else 2  # global_step 2 is seen after step 1; batch_idx 2 is step 2
    assert strategy.engine.steps == first_write + 1  # nothing released after the write


class LateRunningMean(Classifier):
    """From the third step on, its forward keeps the batch's mean in a buffer (a running statistic); its
    ``on_train_batch_end`` only counts its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running", torch.zeros(4))
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        if self.trainer.global_step >= 2:
            with torch.no_grad():
                self.running.copy_(x.mean(0))
        return super().forward(x)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.calls += 1


def test_a_buffer_the_forward_writes_from_the_batch_is_refused_as_the_forwards_not_the_hooks():
    """The hooks' run on the previous step's counters starts from what the forward wrote: a forward's buffer
    is refused as the forward's, not blamed on an after-step hook that wrote nothing."""
    strategy = DPStrategy(noise_multiplier=0.0, max_grad_norm=0.1, seed=0, check_sensitivity="every_step")
    loader = DataLoader(data(64), batch_size=8)
    with pytest.raises(DPConfigurationError) as refusal:
        make_trainer(strategy, max_steps=6).fit(LateRunningMean(), train_dataloaders=loader)
    message = str(refusal.value)
    assert "buffers ['running'] were written from the batch in the forward" in message
    assert AFTER_STEP not in message


class GradientStashEveryThirdStep(Classifier):
    """Copies the NON-private gradient into a buffer the next forward reads, in ``on_after_backward`` on every
    third step only: the checked first batch runs at a step count on which it writes nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("shift", torch.zeros(3))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x) + self.shift, y)

    def on_after_backward(self) -> None:
        if self.trainer.global_step % 3 == 2:
            self.shift.copy_(self.l2.bias.grad)


def test_a_step_hook_that_writes_on_some_steps_only_is_refused_on_the_next_step():
    """The buffer written on an unchecked step makes the next batch a checked one, whose passes run the step
    hooks on the previous step's count too: refused before the next release."""
    strategy = DPStrategy(noise_multiplier=0.0, max_grad_norm=0.1, seed=0)
    loader = DataLoader(data(256), batch_size=16)
    with pytest.raises(DPConfigurationError, match="were written inside the optimizer step by") as refusal:
        make_trainer(strategy, max_steps=12).fit(GradientStashEveryThirdStep(), train_dataloaders=loader)
    assert "GradientStashEveryThirdStep.on_after_backward" in str(refusal.value)
    assert strategy.engine.steps == 3  # step 2 wrote it; nothing released after


class ShiftBeforeOptimizerStepEveryThirdStep(Classifier):
    """Moves ``l2.bias`` by the batch's mean (kept on ``self`` in training_step) in ``on_before_optimizer_step``
    on every third step only; the optimizer's own write follows and hides it from the between-step watch."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self.kept = batch[0].detach()
        return super().training_step(batch, batch_idx)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.trainer.global_step % 3 == 2:
            with torch.no_grad():
                self.l2.bias.add_(self.kept.mean(0)[:3])


def test_a_parameter_written_before_the_optimizer_step_on_some_steps_only_is_refused_on_the_next_step():
    strategy = DPStrategy(noise_multiplier=0.0, max_grad_norm=0.1, seed=0)
    loader = DataLoader(data(256), batch_size=16)
    module = ShiftBeforeOptimizerStepEveryThirdStep()
    with pytest.raises(DPConfigurationError, match="were written inside the optimizer step by") as refusal:
        make_trainer(strategy, max_steps=12).fit(module, train_dataloaders=loader)
    assert "ShiftBeforeOptimizerStepEveryThirdStep.on_before_optimizer_step" in str(refusal.value)
    assert strategy.engine.steps == 3  # step 2 wrote it; nothing released after


class Teacher(Classifier):
    """Post-processing after the step: an EMA teacher (frozen), clamping, a reset on a step schedule, a
    mask from the released gradient; and a counter of the hook's calls (Python state)."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher = nn.Linear(4, 8).requires_grad_(False)
        self.calls = 0

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.calls += 1
        with torch.no_grad():
            self.teacher.weight.mul_(0.9).add_(0.1 * self.l1.weight)
            self.l1.weight.clamp_(-0.4, 0.4)
            if self.trainer.global_step % 2 == 0:
                self.l2.bias.zero_()
            self.l2.weight[self.l2.weight.grad.abs() < 1e-4] *= 0.5


class Stopper(Callback):
    """Records the step count it sees, and stops the fit after the third step."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append(trainer.global_step)
        trainer.should_stop = trainer.global_step >= 3


def test_writes_after_the_step_that_read_no_private_data_train_as_without_the_checks():
    runs = []
    for setting in ("every_step", False):
        torch.manual_seed(0)
        module, stopper = Teacher(), Stopper()
        strategy = fit(
            module, data(64), 8, max_steps=6, callbacks=[stopper], dp={"check_sensitivity": setting}
        )
        runs.append((module, stopper, strategy))
    (checked, stopper, strategy), (unchecked, plain_stopper, _) = runs
    assert strategy.checks.mixing.checked_steps == [0, 1, 2]  # stopped after the third step, as unchecked
    assert checked.calls == unchecked.calls == 3
    assert stopper.seen == plain_stopper.seen == [1, 2, 3]
    for a, b in zip(checked.parameters(), unchecked.parameters(), strict=True):
        assert torch.equal(a, b)


# -- 2. reduced precision does not widen the check ----------------------------------------------------------


class BatchLabelSmoothing(Classifier):
    """Label smoothing towards the batch's class frequencies: every example's target reads the batch (at
    B = 4096 the check's pass B moves the kept examples' clipped sum by about 1·C; in bf16 the old
    allowance was about 1.9·C)."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        target = 0.97 * F.one_hot(y, 3).float() + 0.03 * torch.bincount(y, minlength=3).float() / len(y)
        return -(target * F.log_softmax(self(x), 1)).sum(1).mean()


@pytest.mark.parametrize(("precision", "b"), [("bf16-mixed", 4096), ("bf16-true", 1024)])
def test_reduced_precision_refuses_a_move_of_c_at_a_large_batch_and_trains_a_correct_model(precision, b):
    refused(BatchLabelSmoothing(), data(b), b, MIXING, max_steps=1, precision=precision)
    assert fit(Classifier(), data(b), b, max_steps=1, precision=precision).checks.mixing.checked_steps == [0]


@pytest.mark.parametrize("kept", [64, 2048, 8192, 65536])
def test_the_rounding_allowance_stays_far_below_c_at_any_batch_size(kept):
    """Every kept example clipped to C (the worst case): fp32 partial sums of at most summation_chunk(K)
    examples keep the allowance below C/4, where one fp32 sum over K = 8192 would allow 2·C."""
    clipped = torch.ones(kept, dtype=torch.float64)
    allowance = move_tolerance(clipped, 1.0, FP32_EXAMPLE_ROUNDING, min(kept, summation_chunk(kept)))
    assert allowance < 0.25
    if kept >= 8192:
        assert move_tolerance(clipped, 1.0, FP32_EXAMPLE_ROUNDING) > 1.0  # one fp32 sum would hide C
    assert 2 * summation_chunk(kept) * _U32 * kept <= 1 / 16


class HandCast(Classifier):
    """Casts its activations to bf16 by hand: runs under autocast, not in plain fp32."""

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(torch.relu(self.l1(x)).to(torch.bfloat16))


def test_a_step_that_cannot_run_in_fp32_is_checked_in_its_own_precision_with_a_warning():
    with pytest.warns(UserWarning, match="could not run your training_step in fp32"):
        strategy = fit(HandCast(), data(16), 8, precision="bf16-mixed")
    assert strategy.checks.mixing.checked_steps == [0]
    assert strategy.checks.mixing.precision_fallback


# -- 3. oversampling inside the batch -----------------------------------------------------------------------


class InBatchSmote(Classifier):
    """SMOTE in the batch: each minority row moves towards its nearest minority neighbour (random λ)."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        rows = (y == 2).nonzero().squeeze(1)
        if len(rows) >= 2:
            distance = torch.cdist(x[rows], x[rows]).fill_diagonal_(math.inf)
            partner = rows[distance.argmin(1)]
            x = x.clone()
            x[rows] = x[rows] + torch.rand(len(rows), 1) * (x[partner] - x[rows])
        return F.cross_entropy(self(x), y)


@pytest.mark.parametrize("minority", [2, 3, 8])
def test_in_batch_oversampling_is_refused_by_its_cause(minority):
    """One row of a rare class is changed and another kept, so the kept row's dependence on its neighbour
    shows whatever else the check changes (a minority row is often the batch's largest gradient)."""
    refused(InBatchSmote(), data(256, seed=minority, minority=minority), 256, MIXING)


def test_a_rare_class_in_a_correct_model_trains_with_every_step_checked():
    strategy = fit(Classifier(), data(512, minority=4), 256, dp={"check_sensitivity": "every_step"})
    assert strategy.checks.mixing.checked_steps == [0, 1]


# -- 5. messages hold no statistic of the private batch -----------------------------------------------------


class BatchMean(Classifier):
    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x - x.mean(0))


def test_the_mixing_refusal_names_the_cause_and_the_fix_without_private_statistics():
    message = refused(BatchMean(), data(37), 37, MIXING)
    assert "37" not in message
    assert "·C in total" not in message
    assert "rounding explains" in message
    assert not re.search(r"\d\.\d+%|\d+\.\d+·C|of them", message)
    assert not re.search(r"(example|user) \d", message)  # no position: it bounds the batch's size
    assert "isolate_examples=True" in message
    assert "per_example_token_loss" in message


# -- 7. mixing that starts later is refused before its first release ---------------------------------------


class MixupFromEpoch1(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        if self.current_epoch >= 1:
            x = 0.7 * x + 0.3 * x.roll(1, 0)
        return F.cross_entropy(self(x), y)


class Curriculum(Classifier):
    """Switches to centring by the batch's mean once a batch's loss falls below a threshold; counts its
    steps and logs the last loss in attributes too (values that change every step: no checks from them)."""

    def __init__(self) -> None:
        super().__init__()
        self.hard, self.count, self.last = False, 0, 0.0

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x - x.mean(0) if self.hard else x), y)
        self.count, self.last = self.count + 1, float(loss)
        self.hard = self.hard or (self.count >= 6 and float(loss) < 10.0)
        return loss


def test_mixing_that_starts_at_an_epoch_or_after_a_switch_is_refused_before_its_first_release():
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
    with pytest.raises(DPConfigurationError, match=MIXING):
        make_trainer(strategy, max_epochs=3).fit(MixupFromEpoch1(), DataLoader(data(80), batch_size=8))
    assert strategy.engine.steps == 10  # the first batch of epoch 1
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
    with pytest.raises(DPConfigurationError, match=MIXING):
        make_trainer(strategy, max_epochs=1).fit(Curriculum(), DataLoader(data(160), batch_size=8))
    assert strategy.engine.steps == 6  # the switch came with step 5: step 6 is the first that mixes


class Scheduled(Classifier):
    """A per-step learning-rate schedule and a counter: schedules, not changes (no checks from them)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self.count += 1
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return [optimizer], [torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s))]


def test_schedules_that_change_every_step_do_not_check_every_step():
    strategy = fit(Scheduled(), data(320), 8, max_steps=40, dp={"noise_multiplier": 1.0})
    assert strategy.checks.checked_after_change <= 2
    assert len(strategy.checks.mixing.checked_steps) <= 8


def test_a_setting_that_flips_makes_the_next_batch_checked_and_a_schedule_does_not():
    """ChangeWatch alone: a flag that flips after holding still counts; a counter that moves every step, or
    a flag that flips every other step, counts at most once; a stage that moves every 8 steps counts at
    most log₂ 8 + 1 times."""
    from lightning_dp.checks.changes import ChangeWatch

    module, watch = Classifier(), ChangeWatch()
    module.flag, module.count, module.phase, module.stage = False, 0, False, 0
    found: dict[str, int] = {}
    for step in range(64):
        module.count, module.phase, module.stage = step, step % 2 == 1, step // 8
        module.flag = step >= 40
        module.l1.requires_grad_(step < 50)
        for key in watch.observe(module, None, None, ["teacher.weight"] if step >= 30 else []):
            found[key] = found.get(key, 0) + 1
    assert found.pop("Classifier.flag") == 1
    assert found.pop("trained parameters") == 1
    assert found.pop("written between steps: teacher.weight") == 1
    assert found.pop("Classifier.stage") <= 4
    assert found.get("Classifier.phase", 0) <= 1
    assert "Classifier.count" not in found


def test_a_quoted_exception_of_yours_keeps_its_words_not_its_numbers():
    """The refusals that quote your step's or hook's exception on a batch the check made drop its numbers
    (a shape there is the private batch's size)."""
    from lightning_dp.core.errors import quote_error

    quoted = quote_error(RuntimeError("shape '[274, 8]' is invalid for input of size 2192"))
    assert quoted == "RuntimeError: shape '[…, …]' is invalid for input of size …"
