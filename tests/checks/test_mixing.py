"""Run-time checks on the real batches (issue #28): mixing is refused wherever and whenever it happens,
before the release it would break, and standard models are never refused.

Each mixing pattern is shown to leak with the neighbour test (one private step with and without an
example, check off: the clipped sum moves by more than C) and to be refused with the check on, with
nothing released from a mixed batch: a release hook records, for every release, whether the real step
that produced it mixed (the model notes its own decision on every call; the real step's call is the
last before its release).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import TinyModule, make_trainer
from lightning.pytorch import Callback, seed_everything
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from lightning_dp import DPConfigurationError, DPStrategy
from lightning_dp.slots.release import ReleaseHook

MIXING = "Sensitivity check failed"
HOOKED = "is not the batch the sampler drew"
BUFFERS = "were written between two training steps"


def _mix(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    partner = torch.randperm(len(x))
    return 0.5 * x + 0.5 * x[partner], y, y[partner]


class Pattern(TinyModule):
    """A TinyModule whose ``training_step`` mixes examples when ``mixes(x, batch_idx)`` says so; every call
    notes whether it mixed (``decisions``), so a test can tell which releases came from mixed batches."""

    def __init__(self, n: int = 64, batch_size: int = 16, **kwargs: Any) -> None:
        super().__init__(n=n, batch_size=batch_size, **kwargs)
        self.decisions: list[bool] = []

    def mixes(self, x: Tensor, batch_idx: int) -> bool:
        return True

    def features(self, x: Tensor) -> Tensor:
        return x

    def training_step(self, batch, batch_idx):
        x, y = batch
        mixed = self.mixes(x, batch_idx)
        self.decisions.append(mixed)
        if mixed:
            x, y_a, y_b = _mix(x, y)
            out = self(x)
            return 0.5 * F.cross_entropy(out, y_a) + 0.5 * F.cross_entropy(out, y_b)
        return F.cross_entropy(self(self.features(x)), y)


class FromEpochOne(Pattern):
    def mixes(self, x, batch_idx):
        return self.current_epoch >= 1


class OddBatches(Pattern):
    def mixes(self, x, batch_idx):
        return batch_idx % 2 == 1


class LargeBatches(Pattern):
    def mixes(self, x, batch_idx):
        return len(x) > 4


class TorchCoin(Pattern):
    def mixes(self, x, batch_idx):
        return bool(torch.rand(()) < 0.3)


class NumpyCoin(Pattern):
    def mixes(self, x, batch_idx):
        return bool(np.random.rand() < 0.3)


class RandomApplyMixup(Pattern):
    """torchvision's RandomApply (p = 0.3) deciding whether the batch is mixed."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from torchvision.transforms import RandomApply

        self.applied = False
        outer = self

        class Mark(nn.Module):
            def forward(self, t: Tensor) -> Tensor:
                outer.applied = True
                return t

        self.coin = RandomApply(nn.ModuleList([Mark()]), p=0.3)

    def mixes(self, x, batch_idx):
        self.applied = False
        self.coin(x)
        return self.applied


class PreviousRow(Pattern):
    """Each row blended with the previous one (rolled: flows from earlier rows to later ones)."""

    def mixes(self, x, batch_idx):
        return False

    def features(self, x):
        return x + 0.5 * torch.cat([torch.zeros_like(x[:1]), x[:-1]])


class Differences(Pattern):
    def mixes(self, x, batch_idx):
        return False

    def features(self, x):
        return torch.diff(x, dim=0, prepend=x[:1])


class RelativeToFirst(Pattern):
    def mixes(self, x, batch_idx):
        return False

    def features(self, x):
        return x - x[:1]


def _class_sorted(module: TinyModule) -> None:
    """Sort the module's data by class, the order ImageFolder gives."""
    order = module.y.argsort(stable=True)
    module.x, module.y = module.x[order], module.y[order]


class SupCon(Pattern):
    """A supervised contrastive loss over the batch (positives: same label), on class-sorted data."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        _class_sorted(self)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.decisions.append(True)
        z = F.normalize(self.net(x), dim=1)
        sim = z @ z.T / 0.5
        eye = torch.eye(len(x), dtype=torch.bool)
        positives = (y[:, None] == y[None, :]) & ~eye
        log_prob = sim - torch.logsumexp(sim.masked_fill(eye, -1e9), dim=1, keepdim=True)
        per_example = -(log_prob * positives).sum(1) / positives.sum(1).clamp(min=1)
        return per_example.mean()


class BatchHardTriplet(SupCon):
    def training_step(self, batch, batch_idx):
        x, y = batch
        self.decisions.append(True)
        z = self.net(x)
        d = torch.cdist(z, z)
        same = y[:, None] == y[None, :]
        hardest_positive = (d * same).max(1).values
        hardest_negative = d.masked_fill(same, 1e9).min(1).values
        return F.relu(hardest_positive - hardest_negative + 1.0).mean()


class CenterLoss(SupCon):
    """Cross-entropy plus the distance to the batch's own mean of the example's class."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.decisions.append(True)
        z = self.net(x)
        onehot = F.one_hot(y, 3).float()
        centers = (onehot.T @ z) / onehot.sum(0).clamp(min=1)[:, None]
        return F.cross_entropy(z, y) + (z - centers[y]).square().sum(1).mean()


class NoneFirst(Pattern):
    """Returns no loss on its first batch (an InfoNCE that skips a batch), mixes on every other."""

    def training_step(self, batch, batch_idx):
        if batch_idx == 0:
            self.decisions.append(False)
            return None
        return super().training_step(batch, batch_idx)


class SupConSkipsWithoutPositives(SupCon):
    """Skips (returns None) a batch where no two examples share a label."""

    def training_step(self, batch, batch_idx):
        _, y = batch
        if len(set(y.tolist())) == len(y):
            self.decisions.append(False)
            return None
        return super().training_step(batch, batch_idx)


class ManualMixup(Pattern):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        opt.step()


class IgnoreIndexLoss(Pattern):
    """cross_entropy(ignore_index=-1) over the batch, where some examples carry no label: the mean's
    denominator counts the labelled examples of the whole batch."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.y = torch.where(torch.arange(len(self.y)) % 3 == 0, -1, self.y)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.decisions.append(True)
        return F.cross_entropy(self(x), y, ignore_index=-1)


class HFPaddedLoss(TinyModule):
    """A tiny GPT-2 LM trained with its own ``labels=`` loss on padded rows (labels -100 on padding):
    the loss is a mean over every labelled token of the batch."""

    def __init__(self) -> None:
        super().__init__(n=32, batch_size=8)
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=17, n_embd=16, n_layer=1, n_head=2, n_positions=12)
        config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
        torch.manual_seed(0)
        self.net = GPT2LMHeadModel(config)
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(1, 17, (32, 12), generator=g)
        lengths = torch.randint(2, 13, (32,), generator=g)
        self.y = torch.where(torch.arange(12) < lengths[:, None], self.x, -100)
        self.decisions: list[bool] = []

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        self.decisions.append(True)
        return self.net(input_ids=ids, attention_mask=(labels != -100).long(), labels=labels).loss


# In training_step, persistent: refused on the first batch with the default (sampled) check.
PERSISTENT = [
    LargeBatches,
    PreviousRow,
    Differences,
    RelativeToFirst,
    SupCon,
    BatchHardTriplet,
    CenterLoss,
    NoneFirst,
    SupConSkipsWithoutPositives,
    ManualMixup,
    IgnoreIndexLoss,
    HFPaddedLoss,
]
# Intermittent: a sampled check finds them on a checked step; check_sensitivity="every_step" before any
# release from a mixed batch.
INTERMITTENT = [FromEpochOne, OddBatches, TorchCoin, NumpyCoin, RandomApplyMixup]


class ReleasedFrom(ReleaseHook):
    """Records, for every release, whether the real step that produced it mixed."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.mixed: list[bool] = []

    def before_noise(self, sums, ctx):
        decisions = self.module.decisions
        self.mixed.append(bool(decisions and decisions[-1]))
        return sums


def _fit(module: Any, setting: Any = True, **trainer_kwargs: Any) -> tuple[DPStrategy, ReleasedFrom]:
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, check_sensitivity=setting)
    released = ReleasedFrom(module)
    strategy.engine.release_hooks.append(released)
    make_trainer(strategy, **trainer_kwargs).fit(module)
    return strategy, released


def _others_move(model: type, neighbour: Any) -> float:
    """How far removing one example moves the other examples' part of the released sum (check off, σ = 0,
    no clipping), relative to the removed example's own gradient: 0 when nothing mixes. Removing the first
    and a middle example: mixing may flow either way along the rows. A move of the others' part is a leak:
    with C near the gradients' norms the released sum then moves by more than C."""
    module = model()
    n = len(module.x)
    worst = 0.0
    for removed in (0, n // 2):

        def strategy() -> DPStrategy:
            return DPStrategy(noise_multiplier=0.0, max_grad_norm=1e6, seed=0, check_sensitivity=False)

        seed_everything(0, verbose=False)
        full = neighbour.released_sum(module, TensorDataset(module.x, module.y), strategy)
        rest = [i for i in range(n) if i != removed]
        kept = neighbour.released_sum(module, TensorDataset(module.x[rest], module.y[rest]), strategy)
        alone = neighbour.released_sum(
            module, TensorDataset(module.x[removed : removed + 1], module.y[removed : removed + 1]), strategy
        )
        own = math.sqrt(sum(float(g.square().sum()) for g in alone.sums))
        typical = math.sqrt(sum(float(g.square().sum()) for g in full.sums)) / n  # an example's share
        others = math.sqrt(
            sum(
                float((a - b - g).square().sum())
                for a, b, g in zip(full.sums, kept.sums, alone.sums, strict=True)
            )
        )
        worst = max(worst, others / max(own, typical))
    return worst


@pytest.mark.parametrize("model", PERSISTENT, ids=lambda m: m.__name__)
def test_mixing_in_training_step_leaks_and_is_refused_before_any_mixed_release(model, neighbour):
    if model not in (NoneFirst, SupConSkipsWithoutPositives, ManualMixup):
        assert _others_move(model, neighbour) > 0.01  # the leak is real
    module = model()
    with pytest.raises(DPConfigurationError, match=MIXING) as refusal:
        _fit(module, max_epochs=2)
    assert "isolate_examples=True" in str(refusal.value)
    assert "per_example_token_loss" in str(refusal.value)


@pytest.mark.parametrize("model", INTERMITTENT, ids=lambda m: m.__name__)
def test_intermittent_mixing_is_refused_before_any_release_from_a_mixed_batch(model):
    module = model()
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, check_sensitivity="every_step")
    released = ReleasedFrom(module)
    strategy.engine.release_hooks.append(released)
    with pytest.raises(DPConfigurationError, match=MIXING) as refusal:
        make_trainer(strategy, max_epochs=4).fit(module)
    assert not any(released.mixed), "a release came from a mixed batch"
    message = str(refusal.value)
    if released.mixed:
        assert f"{len(released.mixed)} releases were made before it" in message
        assert "do not publish a model from this run" in message
    else:
        assert "No release was made before it" in message


def test_sampled_checks_find_intermittent_mixing_and_say_what_earlier_releases_are_covered_by():
    """The default: random steps within the overhead budget (here generous, so the test is quick)."""
    module = FromEpochOne(n=256, batch_size=16)
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, check_overhead=0.9)
    with pytest.raises(DPConfigurationError, match=MIXING) as refusal:
        make_trainer(strategy, max_epochs=20).fit(module)
    message = str(refusal.value)
    assert "the check passed on the batches of steps" in message
    assert strategy.checks.mixing.checked_steps[0] == 0  # the first batch is always checked


def test_a_check_moves_to_the_next_batch_when_training_step_returns_no_loss():
    """Batch 0 returns no loss (a noise-only release); the check moves to batch 1, which mixes."""
    module = NoneFirst()
    strategy = DPStrategy(noise_multiplier=1.0, seed=0)
    with pytest.raises(DPConfigurationError, match="Sensitivity check failed on step 1"):
        make_trainer(strategy, max_steps=3).fit(module)
    assert strategy.engine.steps == 1
    assert strategy.checks.mixing.moved == 1


# -- mixing outside training_step --------------------------------------------------------------------------


class StandardiseInBatchStart(TinyModule):
    def on_train_batch_start(self, batch, batch_idx):
        x = batch[0]
        x.sub_(x.mean(0)).div_(x.std(0) + 1e-5)


class MixupCallback(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        x = batch[0]
        x.copy_(0.5 * x + 0.5 * x.flip(0))


class MixupAfterTransfer(TinyModule):
    def on_after_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        return 0.5 * x + 0.5 * x.flip(0), y


class RunningMeanNormaliser(TinyModule):
    """Normalises inputs by a running mean of past batches, updated in on_train_batch_end."""

    def __init__(self) -> None:
        super().__init__(n=64, batch_size=16)
        self.register_buffer("mean", torch.zeros(10))

    def forward(self, x):
        return self.net(x - self.mean)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.mean.mul_(0.9).add_(0.1 * batch[0].mean(0))


class MoCoQueue(TinyModule):
    """An InfoNCE loss against a queue of past batches' features, updated in on_train_batch_end."""

    def __init__(self) -> None:
        super().__init__(n=64, batch_size=16)
        self.register_buffer("queue", torch.randn(32, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        z = self.net(x)
        logits = z @ self.queue.T
        return F.cross_entropy(z, y) + torch.logsumexp(logits, 1).mean()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        with torch.no_grad():
            z = self.net(batch[0])[:8]
            self.queue.copy_(torch.cat([z, self.queue[: -len(z)]]))


def test_a_batch_edited_in_on_train_batch_start_is_refused_naming_the_hook():
    with pytest.raises(DPConfigurationError, match=HOOKED) as refusal:
        _fit(StandardiseInBatchStart(n=64, batch_size=16), max_steps=2)
    assert "LightningModule.on_train_batch_start" in str(refusal.value)


def test_a_callback_that_mixes_the_batch_is_refused_naming_it():
    with pytest.raises(DPConfigurationError, match=HOOKED) as refusal:
        _fit(TinyModule(n=64, batch_size=16), max_steps=2, callbacks=[MixupCallback()])
    assert "MixupCallback" in str(refusal.value)


def test_a_batch_replaced_in_on_after_batch_transfer_is_refused_naming_the_hook():
    with pytest.raises(DPConfigurationError, match=HOOKED) as refusal:
        _fit(MixupAfterTransfer(n=64, batch_size=16), max_steps=2)
    assert "LightningModule.on_after_batch_transfer" in str(refusal.value)


@pytest.mark.parametrize("model", [RunningMeanNormaliser, MoCoQueue])
def test_buffers_written_from_the_batch_between_steps_are_refused_before_the_next_release(model):
    """Checked, the write is refused before the first release (the check's passes run on_train_batch_end
    too, issue #47); unchecked, a buffer written between steps is still refused before the next one."""
    strategy = DPStrategy(noise_multiplier=1.0, seed=0)
    with pytest.raises(DPConfigurationError, match="were written after the optimizer step by") as refusal:
        make_trainer(strategy, max_steps=3).fit(model())
    assert strategy.engine.steps == 0
    assert f"{model.__name__}.on_train_batch_end" in str(refusal.value)
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, check_sensitivity=False)
    with pytest.raises(DPConfigurationError, match=BUFFERS) as refusal:
        make_trainer(strategy, max_steps=3).fit(model())
    assert strategy.engine.steps == 1  # the first step read only the initial buffer
    assert "public_buffers" in str(refusal.value)


class WeightEMA(TinyModule):
    """Keeps an EMA of the weights in a buffer (a function of released weights: post-processing)."""

    def __init__(self) -> None:
        super().__init__(n=64, batch_size=16)
        self.register_buffer("ema", torch.zeros(16, 10))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.ema.mul_(0.9).add_(0.1 * self.net[0].weight.detach())


def test_a_buffer_declared_public_may_be_written_between_steps():
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, public_buffers=["ema"])
    make_trainer(strategy, max_steps=3).fit(WeightEMA())
    assert strategy.engine.steps == 3
    with pytest.raises(DPConfigurationError, match=BUFFERS):
        make_trainer(DPStrategy(noise_multiplier=1.0, seed=0), max_steps=3).fit(WeightEMA())


class RunningStatInForward(TinyModule):
    """A custom normaliser whose forward updates a running mean from the batch, then uses it."""

    def __init__(self) -> None:
        super().__init__(n=64, batch_size=16)
        self.register_buffer("mean", torch.zeros(10))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.5).add_(0.5 * x.mean(0))
        return self.net(x - self.mean)


def test_a_buffer_the_forward_computes_from_the_batch_is_refused():
    with pytest.raises(DPConfigurationError, match=MIXING) as refusal:
        _fit(RunningStatInForward(), max_steps=2)
    assert "buffers ['mean'] were written from the batch" in str(refusal.value)


# -- isolation ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", [LargeBatches, HFPaddedLoss, SupCon], ids=lambda m: m.__name__)
def test_isolated_examples_cannot_mix(model, neighbour):
    """isolate_examples=True: each example runs through training_step alone, so the clipped sum moves by
    at most C whatever the loss does, and the check has nothing to refuse."""
    module = model()
    data = TensorDataset(module.x, module.y)
    move = neighbour.neighbour_move(
        module,
        data,
        lambda: DPStrategy(noise_multiplier=0.0, max_grad_norm=0.01, seed=0, isolate_examples=True),
        batch_size=len(data),
    )
    neighbour.assert_neighbour_bound(move)
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, isolate_examples=True)
    make_trainer(strategy, max_steps=2).fit(model())
    assert strategy.engine.steps == 2


# -- standard models are not refused -------------------------------------------------------------------------


class PaddedEncoder(TinyModule):
    """nn.TransformerEncoder (dropout 0.1) over padded token sequences with a key padding mask."""

    def __init__(self) -> None:
        super().__init__(n=48, batch_size=12)
        torch.manual_seed(0)
        self.embed = nn.Embedding(13, 16, padding_idx=0)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 3)
        self.net = nn.ModuleList([self.embed, self.encoder, self.head])
        g = torch.Generator().manual_seed(1)
        lengths = torch.randint(2, 9, (48,), generator=g)
        self.x = torch.randint(1, 13, (48, 8), generator=g) * (torch.arange(8) < lengths[:, None])
        self.y = torch.randint(0, 3, (48,), generator=g)

    def training_step(self, batch, batch_idx):
        ids, y = batch
        pad = ids == 0
        h = self.encoder(self.embed(ids), src_key_padding_mask=pad)
        pooled = (h * ~pad[..., None]).sum(1) / (~pad).sum(1, keepdim=True)
        return F.cross_entropy(self.head(pooled), y)


class SpectralNormModel(TinyModule):
    def __init__(self, parametrization: bool) -> None:
        super().__init__(n=64, batch_size=16)
        norm = nn.utils.parametrizations.spectral_norm if parametrization else nn.utils.spectral_norm
        self.net = nn.Sequential(norm(nn.Linear(10, 16)), nn.Tanh(), nn.Linear(16, 3))


class DropPathModel(TinyModule):
    def __init__(self) -> None:
        super().__init__(n=64, batch_size=16)
        from timm.layers import DropPath

        self.block = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.2))
        self.drop_path = DropPath(0.3)
        self.inp, self.out = nn.Linear(10, 16), nn.Linear(16, 3)
        self.net = nn.ModuleList([self.inp, self.block, self.out])

    def forward(self, x):
        h = self.inp(x)
        return self.out(h + self.drop_path(self.block(h)))


@pytest.mark.parametrize(
    "build",
    [
        PaddedEncoder,
        lambda: SpectralNormModel(False),
        lambda: SpectralNormModel(True),
        DropPathModel,
    ],
    ids=[
        "transformer_encoder_padding_dropout",
        "spectral_norm",
        "spectral_norm_parametrization",
        "drop_path",
    ],
)
def test_standard_models_with_randomness_train_under_every_step_checks(build):
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, check_sensitivity="every_step")
    make_trainer(strategy, max_steps=4).fit(build())
    assert strategy.engine.steps == 4
    assert len(strategy.checks.mixing.checked_steps) == 4


def test_the_check_leaves_no_trace(tmp_path):
    """Same seeds with the check on every step and off: the same weights, buffers, ledger, noise stream,
    global random stream and logged metrics."""

    def fit(setting: Any) -> tuple[Any, DPStrategy]:
        seed_everything(0, verbose=False)
        module = DropPathModel()
        module.register_buffer("forwards", torch.zeros(()))
        original = module.forward

        def counting(x):
            module.forwards += 1
            return original(x)

        module.forward = counting
        strategy = DPStrategy(noise_multiplier=1.0, seed=0, check_sensitivity=setting)
        logger = CSVLogger(tmp_path / str(setting), name="", version="")
        make_trainer(strategy, max_steps=3, logger=logger, log_every_n_steps=1).fit(module)
        return module, strategy

    on_module, on = fit("every_step")
    off_module, off = fit(False)
    for a, b in zip(on_module.parameters(), off_module.parameters(), strict=True):
        assert torch.equal(a, b)
    assert float(on_module.forwards) == float(off_module.forwards) == 3  # the check's forwards were undone
    assert on.ledger.history == off.ledger.history
    assert torch.equal(on.engine.generator.get_state(), off.engine.generator.get_state())
    assert (tmp_path / "every_step" / "metrics.csv").read_text() == (
        tmp_path / "False" / "metrics.csv"
    ).read_text()
    assert len(on.checks.mixing.checked_steps) == 3
    assert off.checks.mixing.checked_steps == []


def test_the_budget_is_a_share_of_the_time_outside_the_checks():
    """check_overhead = 0.05 lets the checks add 5 % to a fit with them off: 4.95 s of checks after 100 s
    (95.05 s outside them) is over the budget; 4.7 s is within it (half the eligible batches are drawn)."""
    import time

    from lightning_dp.checks.mixing import MixingCheck

    check = MixingCheck(True, overhead=0.05, seed=0)
    check.start_fit()
    check.due_next = False
    check.started = time.perf_counter() - 100.0
    check.seconds_checking, check._last_cost = 4.9, 0.05
    assert not any(check.due() for _ in range(40))
    check.seconds_checking = 4.65
    assert 5 < sum(check.due() for _ in range(40)) < 35


def test_a_small_overhead_budget_checks_the_first_batch_and_few_others():
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, check_overhead=1e-6)
    make_trainer(strategy, max_steps=12).fit(TinyModule(n=64, batch_size=16))
    assert strategy.checks.mixing.checked_steps == [0]


def test_the_report_says_what_the_checks_covered(tmp_path):
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, check_sensitivity="every_step")
    trainer = make_trainer(strategy, max_steps=3, default_root_dir=str(tmp_path))
    trainer.fit(TinyModule(n=64, batch_size=16))
    import json

    report = json.loads((tmp_path / "privacy_report.json").read_text())
    checks = report["checks"]
    assert checks["mixing"]["checked_steps"] == 3
    assert checks["mixing"]["setting"] == "every step"
    assert checks["batch_integrity"]["batches_compared"] == 3


# -- parameters written in forward -------------------------------------------------------------------------------


class MaxNormEmbedding(TinyModule):
    def __init__(self) -> None:
        super().__init__(n=64, batch_size=16)
        self.net = nn.Sequential(nn.Embedding(10, 8, max_norm=1.0), nn.Flatten(), nn.Linear(8, 3))
        self.x = torch.randint(0, 10, (64, 1))


def test_an_embedding_with_max_norm_is_refused_at_set_up():
    module = MaxNormEmbedding()
    before = copy.deepcopy(module.net[0].weight.detach())
    with pytest.raises(DPConfigurationError, match=r"max_norm=1\.0"):
        _fit(module, max_steps=1)
    assert torch.equal(before, module.net[0].weight.detach())


class WritesWeightsInForward(TinyModule):
    def forward(self, x):
        with torch.no_grad():
            self.net[0].weight[0].copy_(x[0])  # the batch written into the model
        return self.net(x)


@pytest.mark.parametrize("setting", [True, False])
def test_a_parameter_written_during_the_step_is_refused_before_the_release(setting):
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, check_sensitivity=setting)
    with pytest.raises(DPConfigurationError, match="were written in place during"):
        make_trainer(strategy, max_steps=2).fit(WritesWeightsInForward(n=64, batch_size=16))
    assert strategy.engine.steps == 0


def test_tolerance_scales_with_the_compute_dtype():
    from lightning_dp.checks.mixing_tolerance import relative_tolerance

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert relative_tolerance("32-true", cpu) == pytest.approx(1e-2)  # the certified norms' guard
    assert relative_tolerance("32-true", cuda) == pytest.approx(2**-6)
    assert relative_tolerance("bf16-mixed", cpu) == pytest.approx(2**-3)
    assert math.isclose(relative_tolerance("16-mixed", cpu), 16 * 2**-10)


class _RoundingOnly(TinyModule):
    """Most rows' gradients exactly 0 and the rest about 1e-20 that move by 5 % with the batch's size: what
    an overshooting model's saturated softmax showed in CI (most p − 1 round to 0, the others to a few ulps
    that round differently over B and B − 1 rows). The released sum moves by ~1e-21·C: no leak."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        per_example = F.cross_entropy(self(x), y, reduction="none")
        weight = (y == 0).double() * 1e-20 * (1.0 + 0.05 * (len(x) % 2))
        return (per_example * weight.to(per_example.dtype)).mean()


def test_changes_far_below_c_on_near_zero_gradients_are_rounding_not_mixing():
    model = _RoundingOnly(n=64, batch_size=16)
    assert (model.y != 0).float().mean() > 0.5  # the batch's median gradient norm is 0
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, check_sensitivity="every_step")
    make_trainer(strategy, max_steps=4).fit(model)
    assert len(strategy.checks.mixing.checked_steps) == 4
    # The same dependence on the batch's size at a scale that matters is refused (a batch large enough that
    # the rows the check keeps, beside every column's extremes, include some with y = 0).
    loud = _RoundingOnly(n=256, batch_size=64)
    loud.training_step = lambda batch, i: _RoundingOnly.training_step(loud, batch, i) * 1e20  # type: ignore[method-assign]
    with pytest.raises(DPConfigurationError, match=MIXING):
        make_trainer(
            DPStrategy(noise_multiplier=1.0, seed=0, check_sensitivity="every_step"), max_steps=4
        ).fit(loud)


# -- carried over from the fit-start check's tests -------------------------------------------------------------


class _TokenMeanLM(TinyModule):
    """Embedding + head with F.cross_entropy over the batch's flattened tokens (ignore_index=-100): a mean
    over every labelled token of the batch, unequal lengths."""

    def __init__(self) -> None:
        super().__init__(n=32, batch_size=8)
        from neighbour import token_data

        data = token_data(n=32)
        data.tensors[1][::3, :5] = 0  # every third example has 5 labelled tokens, most have 1
        self.x, self.y = data.tensors
        self.net = nn.Sequential(nn.Embedding(11, 8), nn.Tanh(), nn.Linear(8, 11))

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        logits = self.net(tokens)
        return F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), ignore_index=-100)


class _SumWithMean(TinyModule):
    """Returns the batch sum while the strategy is told 'mean': each gradient scales with the batch size."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y, reduction="sum")


def test_a_token_mean_over_the_batch_and_a_sum_called_mean_are_refused():
    with pytest.raises(DPConfigurationError, match=MIXING):
        _fit(_TokenMeanLM(), "every_step", max_epochs=2)
    with pytest.raises(DPConfigurationError, match=MIXING) as refusal:
        _fit(_SumWithMean(n=64, batch_size=16), max_steps=2)
    assert "one example removed" in str(refusal.value)  # nothing random: the check removes examples


def test_a_refused_check_leaves_grads_rng_and_weights_untouched():
    module = LargeBatches()
    before = [p.detach().clone() for p in module.parameters()]
    strategy = DPStrategy(noise_multiplier=1.0, seed=0)
    with pytest.raises(DPConfigurationError, match=MIXING):
        make_trainer(strategy, max_steps=1).fit(module)
    assert all(p.grad is None for p in module.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
    assert strategy.engine.steps == strategy.ledger.steps == 0


@pytest.mark.parametrize(("chunk", "refused"), [(3, True), (1, False)])
def test_virtual_batching_checks_within_a_physical_chunk(chunk, refused):
    """Examples meet only inside a chunk: the check runs on the first chunk; one example cannot mix."""
    from neighbour import BatchStandardised

    strategy = DPStrategy(noise_multiplier=1.0, seed=0, max_physical_batch_size=chunk)
    module = BatchStandardised(n=32, batch_size=8)
    if refused:
        with pytest.raises(DPConfigurationError, match=MIXING):
            make_trainer(strategy, max_steps=1).fit(module)
    else:
        make_trainer(strategy, max_steps=2).fit(module)
        assert strategy.engine.steps == 2


def test_the_check_runs_under_bf16_mixed_and_with_dpis():
    from lightning_dp import DPIS

    strategy = DPStrategy(noise_multiplier=1.0, seed=0, check_sensitivity="every_step")
    make_trainer(strategy, max_steps=2, precision="bf16-mixed").fit(TinyModule(n=64, batch_size=16))
    assert strategy.checks.mixing.checked_steps == [0, 1]
    dpis = DPStrategy(sampler=DPIS(k=3, seed=0), noise_multiplier=1.0, seed=0)
    with pytest.raises(DPConfigurationError, match=MIXING):
        make_trainer(dpis, max_steps=1).fit(LargeBatches(n=400, batch_size=10))


class _TwoDropouts(TinyModule):
    """Dropout after two layers (the second mask's offset moves with the batch size); ``mix_in_train`` adds
    a batch mean to the hidden layer in train mode only: a real mixing the check must still find."""

    def __init__(self, mix_in_train: bool = False) -> None:
        super().__init__(n=64, batch_size=16)
        self.net = nn.Sequential(
            nn.Linear(10, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 16), nn.Tanh(), nn.Dropout(0.3)
        )
        self.head = nn.Linear(16, 3)
        self.mix_in_train = mix_in_train

    def forward(self, x):
        h = self.net(x)
        if self.mix_in_train and self.training:
            h = h + 0.5 * h.mean(0, keepdim=True)
        return self.head(h)


def test_dropout_passes_and_mixing_only_in_train_mode_is_refused():
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, check_sensitivity="every_step")
    make_trainer(strategy, max_steps=3).fit(_TwoDropouts())
    assert strategy.checks.mixing.checked_steps == [0, 1, 2]
    with pytest.raises(
        DPConfigurationError, match=r"one example removed"
    ):  # the masks replayed row by row: removal
        make_trainer(DPStrategy(noise_multiplier=1.0, seed=0), max_steps=1).fit(
            _TwoDropouts(mix_in_train=True)
        )
