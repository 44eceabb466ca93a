"""Ordinary batch-dependent code, generated systematically, against the run-time checks (issue #36).

Every statistic a loss or a layer can take over the batch (min, max, top-k, sort and rank, median,
quantile, counts, mean, std, norm, softmax over the batch), placed where user code runs (the forward, the
loss, a custom autograd backward, a buffer, an observer, a data-dependent initialisation), at B = 8, 256
and 1024 on a 4→3 Linear. Each case must be refused before its first release, or be exact (the neighbour
test: the released sum moves by at most C). Controls with randomness or state that does not depend on the
batch must train with every step checked.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import make_trainer
from lightning.pytorch import Callback, LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy
from lightning_dp.checks.mixing_rows import choose_rows, field_extremes, norm_extremes, rare_values
from lightning_dp.core.errors import DPConfigurationError

Stat = Callable[[Tensor], Tensor]
"""A statistic over the batch: [B, k] → [1, k] (an aggregate) or [B, k] (per row, relative to the batch)."""


def _topk(v: Tensor) -> Tensor:
    return v.topk(max(1, len(v) // 8), dim=0).values.mean(0, keepdim=True)


def _rank(v: Tensor) -> Tensor:
    return v.argsort(0).argsort(0).to(v.dtype) / len(v)


STATS: dict[str, Stat] = {
    "min": lambda v: v.min(0, keepdim=True).values,
    "max": lambda v: v.max(0, keepdim=True).values,
    "topk": _topk,
    "rank": _rank,
    "median": lambda v: v.median(0, keepdim=True).values,
    "quantile": lambda v: torch.quantile(v, 0.9, dim=0, keepdim=True),
    "count": lambda v: (v > v[:, :1].mean()).to(v.dtype).sum(0, keepdim=True) / 64,
    "mean": lambda v: v.mean(0, keepdim=True),
    "std": lambda v: v.std(0, keepdim=True),
    "norm": lambda v: v.norm(dim=0, keepdim=True) / 16,
    "softmax": lambda v: torch.softmax(v, dim=0) * 4,
}
PLACES = ("forward", "loss", "backward", "buffer", "observer", "init")
SIZES = (8, 256, 1024)


def _scale(s: Tensor) -> Tensor:
    """A factor that follows the statistic (bounded, never 0)."""
    return 1.5 + torch.tanh(s)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward scales the incoming gradient by a statistic of it over the batch."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, stat: Any) -> Tensor:
        ctx.stat = stat
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * _scale(ctx.stat(grad * grad.shape[0])), None


class Gain(nn.Module):
    """A frozen per-feature gain (what an ActNorm layer sets at initialisation)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1, 4), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight


class Generated(LightningModule):
    """A 4→3 Linear classifier whose step takes ``stat`` over the batch in ``place``."""

    def __init__(self, stat: str, place: str) -> None:
        super().__init__()
        self.stat, self.place = STATS[stat], place
        self.lin = nn.Linear(4, 3)
        self.register_buffer("seen", torch.zeros(1, 4))
        self.register_buffer("lo", torch.full((1, 4), math.inf))
        self.register_buffer("hi", torch.full((1, 4), -math.inf))
        self.gain = Gain()
        self.initialised = False

    def aggregate(self, x: Tensor) -> Tensor:
        return self.stat(x).mean(0, keepdim=True)

    def forward(self, x: Tensor) -> Tensor:
        if self.place == "forward":
            x = x * _scale(self.stat(x))
        elif self.place == "buffer":
            self.seen.copy_(self.aggregate(x).detach())
            x = x * _scale(self.seen)
        elif self.place == "observer":  # a quantisation observer: running min/max, then fake-quantise
            with torch.no_grad():
                s = self.stat(x)
                self.lo.copy_(torch.minimum(self.lo, s.min(0, keepdim=True).values))
                self.hi.copy_(torch.maximum(self.hi, s.max(0, keepdim=True).values))
            step = (self.hi - self.lo).clamp(min=1e-3) / 15
            x = x + ((x / step).round() * step - x).detach()
        elif self.place == "init" and not self.initialised:  # ActNorm / LSUV: set from the first batch
            self.gain.weight.data.copy_(1 / _scale(self.aggregate(x)))
            self.initialised = True
        return self.lin(self.gain(x))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        if self.place == "backward":
            logits = _ScaleGrad.apply(logits, self.stat)
        losses = F.cross_entropy(logits, y, reduction="none")
        if self.place == "loss":
            losses = losses * _scale(self.stat(losses[:, None]))[:, 0]
        return losses.mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def data(b: int, seed: int = 0, minority: int = 1) -> TensorDataset:
    """B examples: heavy-tailed features (an outlier holds each column's extreme), labels of 3 classes with
    class 2 held by ``minority`` examples (a rare label)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 4, generator=g)
    x[int(torch.randint(b, (), generator=g))] *= 6
    y = torch.randint(0, 2, (b,), generator=g)
    y[torch.randperm(b, generator=g)[:minority]] = 2
    return TensorDataset(x, y)


def _strategy(max_grad_norm: float = 0.1, **kwargs: Any) -> DPStrategy:
    return DPStrategy(noise_multiplier=0.0, max_grad_norm=max_grad_norm, seed=0, **kwargs)


def _cases() -> list[Any]:
    """Every statistic in every place, each at one batch size, cycled so that every statistic and every
    place meets all three sizes."""
    out = []
    for i, stat in enumerate(STATS):
        for j, place in enumerate(PLACES):
            b = SIZES[(i + j) % 3]
            out.append(pytest.param(stat, place, b, id=f"{stat}-{place}-B{b}"))
    return out


def _refused_or_exact(
    make: Callable[[], LightningModule], dataset: TensorDataset, b: int, neighbour: Any
) -> bool:
    """Refused before the first release (True), or exact: one example moves the released sum by at most C."""
    strategy = _strategy()
    try:
        make_trainer(strategy, max_steps=1).fit(make(), train_dataloaders=DataLoader(dataset, batch_size=b))
    except DPConfigurationError:
        assert strategy.engine.steps == 0, "a release came before the refusal"
        return True
    move = neighbour.neighbour_move(make(), dataset, lambda: _strategy(check_sensitivity=False), batch_size=b)
    neighbour.assert_neighbour_bound(move)
    return False


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize(("stat", "place", "b"), _cases())
def test_batch_dependent_code_is_refused_before_its_first_release_or_is_exact(stat, place, b, neighbour):
    _refused_or_exact(lambda: Generated(stat, place), data(b), b, neighbour)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("b", SIZES)
def test_every_statistic_at_every_size_in_the_forward_and_the_loss(b, neighbour):
    """The two commonest places, the full product with the batch sizes; most are refused (a statistic
    whose effect on the others stays below C, such as a count at B = 1024, may pass as exact)."""
    refused = [
        _refused_or_exact(functools.partial(Generated, stat, place), data(b, seed=1), b, neighbour)
        for stat in STATS
        for place in ("forward", "loss")
    ]
    assert sum(refused) >= len(refused) - 3


# -- the issue's named cases, each at a large batch ------------------------------------------------------------


class Standardised(Generated):
    """x / x.std(0): a batch statistic in a denominator, spread thinly over a large batch."""

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x / x.std(0))


class ClassBalanced(Generated):
    """Class weights from the batch's label counts (a singleton class weighs the most)."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        counts = torch.bincount(y, minlength=3).float()
        weights = (len(y) / (3 * counts.clamp(min=1)))[y]
        return (F.cross_entropy(self(x), y, reduction="none") * weights).mean()


class HardMining(Generated):
    """Top-k hard-example mining: only the batch's k largest losses train."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        losses = F.cross_entropy(self(x), y, reduction="none")
        k = max(1, len(losses) // 4)
        return losses.topk(k).values.sum() / len(losses)


class MinMaxScaled(Generated):
    """Min-max scaling over the batch (68·C when the outlier record is removed, in the issue)."""

    def forward(self, x: Tensor) -> Tensor:
        lo, hi = x.min(0).values, x.max(0).values
        return self.lin((x - lo) / (hi - lo))


class Oversampled(Generated):
    """In-batch oversampling of the minority class: each of its examples counts as many times as the batch
    has majority examples per minority example (repetition, written as a weight)."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        minority = y == 2
        repeats = (~minority).sum() / minority.sum().clamp(min=1)
        weights = torch.where(minority, repeats.float(), 1.0)
        return (F.cross_entropy(self(x), y, reduction="none") * weights).mean()


class SelfPaced(Generated):
    """Self-paced weights relative to the batch's largest loss."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        losses = F.cross_entropy(self(x), y, reduction="none")
        return (losses * (1 - losses.detach() / losses.detach().max())).mean()


NAMED = [Standardised, ClassBalanced, HardMining, MinMaxScaled, Oversampled, SelfPaced]


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("model", NAMED, ids=lambda m: m.__name__)
def test_the_issues_cases_are_refused_at_a_large_batch(model):
    """Oversampling moves only the minority's own gradients: with three minority examples and C above the
    gradients (nothing clipped), removing one of them scales the others."""
    b = 1024 if model is not Standardised else 4096
    strategy = _strategy(max_grad_norm=10.0 if model is Oversampled else 0.1)
    dataset = data(b, seed=2, minority=3 if model is Oversampled else 1)
    with pytest.raises(DPConfigurationError, match="Sensitivity check failed"):
        make_trainer(strategy, max_steps=1).fit(
            model("mean", "none"), train_dataloaders=DataLoader(dataset, batch_size=b)
        )
    assert strategy.engine.steps == 0


# -- controls: must train, every step checked ------------------------------------------------------------------


class Plain(Generated):
    """Nothing mixes: the mean of per-example losses."""

    def __init__(self) -> None:
        super().__init__("mean", "none")


class WithDropout(Plain):
    def forward(self, x: Tensor) -> Tensor:
        return self.lin(F.dropout(x, 0.3, self.training))


class WithDropPath(Plain):
    """Stochastic depth: each example's residual branch is dropped with probability 0.3."""

    def __init__(self) -> None:
        super().__init__()
        self.branch = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        keep = (torch.rand(len(x), 1) > 0.3).to(x.dtype) / 0.7 if self.training else 1.0
        return self.lin(x + keep * self.branch(x))


class WithSpectralNorm(Plain):
    """Spectral norm: a power iteration writes its vectors (buffers) in every forward, from the weights."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.utils.parametrizations.spectral_norm(nn.Linear(4, 3))


class WithWeightEMA(Plain):
    """An EMA of the weights in a buffer, written after each optimizer step (declared public)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", self.lin.weight.detach().clone())

    def on_train_batch_end(self, *args: Any) -> None:
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * self.lin.weight)


class WithStepCounter(Plain):
    """A buffer the forward writes from the step count only (passes: it moves the same in both passes)."""

    def forward(self, x: Tensor) -> Tensor:
        self.seen.add_(1)
        return self.lin(x)


CONTROLS = [Plain, WithDropout, WithDropPath, WithSpectralNorm, WithWeightEMA, WithStepCounter]


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("b", SIZES)
@pytest.mark.parametrize("model", CONTROLS, ids=lambda m: m.__name__)
def test_controls_train_with_every_step_checked(model, b):
    strategy = DPStrategy(
        noise_multiplier=1.0,
        max_grad_norm=0.1,
        seed=0,
        check_sensitivity="every_step",
        public_buffers=("ema",),
    )
    dataset = data(3 * b, seed=3)
    make_trainer(strategy, max_steps=2).fit(model(), train_dataloaders=DataLoader(dataset, batch_size=b))
    assert strategy.checks.mixing.checked_steps == [0, 1]


# -- writes the version counters do not see ------------------------------------------------------------------------


class ActNorm(Plain):
    """ActNorm-style data-dependent initialisation through ``.data``, guarded by a Python flag."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.initialised:
            self.gain.weight.data.copy_(1 / (x.std(0, keepdim=True) + 1))
            self.lin.bias.data.copy_(-self.lin(x).mean(0).detach())
            self.initialised = True
        return self.lin(self.gain(x))


class Involution(Plain):
    """A flag-guarded write that a second run of the same initialisation undoes (a sign flip): the probe's
    two passes (two and three copies) would put the weight back, so it is compared after each pass."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.initialised:
            self.lin.bias.data.neg_()
            self.initialised = True
        return self.lin(self.gain(x))


class DataWriteEveryStep(Plain):
    """Writes the batch's mean into a weight through ``.data`` on every forward (no version bump)."""

    def forward(self, x: Tensor) -> Tensor:
        self.gain.weight.data[0] = x.mean(0)
        return self.lin(self.gain(x))


class SetWrite(Plain):
    """Replaces a weight's storage with ``set_`` under ``no_grad`` from the batch."""

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            self.gain.weight.set_(x.mean(0, keepdim=True).clone())
        return self.lin(self.gain(x))


class BufferDataWrite(Callback):
    """Writes a buffer from the batch through ``.data`` between steps."""

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        module.seen.data.copy_(batch[0].mean(0, keepdim=True))


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize(
    "model", [ActNorm, Involution, DataWriteEveryStep, SetWrite], ids=lambda m: m.__name__
)
@pytest.mark.parametrize("setting", [True, False])
def test_parameter_writes_are_found_by_value_before_any_release(model, setting):
    module = model()
    before = [p.detach().clone() for p in module.parameters()]
    strategy = _strategy(check_sensitivity=setting)
    with pytest.raises(DPConfigurationError, match="were written in place during"):
        make_trainer(strategy, max_steps=2).fit(module, train_dataloaders=DataLoader(data(16), batch_size=16))
    assert strategy.engine.steps == 0
    if model in (
        ActNorm,
        Involution,
    ):  # caught in the structure probe, the first code to see a record: put back
        assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize(
    ("setting", "match", "steps"),
    [
        (True, "were written after the optimizer step by BufferDataWrite", 0),
        (False, "between two training", 1),
    ],
)
def test_a_buffer_written_through_data_between_steps_is_refused(setting, match, steps):
    """Checked (the passes run the callback too, issue #47): before the first release; unchecked: before the
    next one."""
    strategy = _strategy(check_sensitivity=setting)
    with pytest.raises(DPConfigurationError, match=match):
        make_trainer(strategy, max_steps=3, callbacks=[BufferDataWrite()]).fit(
            Plain(), train_dataloaders=DataLoader(data(16), batch_size=8)
        )
    assert strategy.engine.steps == steps


# -- which rows pass B changes, and how often a dependence on one record is caught ---------------------------------


def test_the_rows_holding_an_extreme_or_a_rare_label_are_changed_on_every_check():
    x, y = data(256, seed=4).tensors
    norms = torch.rand(256, generator=torch.Generator().manual_seed(0)).double()
    must = set(field_extremes((x, y), 256)) | set(rare_values((x, y), 256)) | set(norm_extremes(norms))
    assert int((y == 2).nonzero()[0]) in rare_values((x, y), 256)
    assert {int(i) for i in x.argmax(0)} <= set(field_extremes((x, y), 256))
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        assert must <= set(choose_rows((x, y), 256, norms, g))


@pytest.mark.parametrize("b", [2, 3, 8, 256, 1024])
def test_any_one_record_is_changed_with_probability_at_least_one_half(b):
    """The measured probability that one check changes a given ordinary record (so that a dependence on
    it shows); 7 checked batches that hold it then catch it with probability ≥ 1 − 2⁻⁷ > 99 %."""
    x = torch.zeros(b, 4)  # no extremes (ties: argmax takes row 0), no labels
    x[0] = 1.0
    norms = torch.ones(b, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    draws = 400
    counts = torch.zeros(b)
    for _ in range(draws):
        rows = choose_rows((x,), b, norms, g)
        assert 1 <= len(rows) < b  # something changes, something is kept
        counts[list(rows)] += 1
    rate = counts / draws
    ordinary = rate[2:-1] if b > 3 else rate  # rows 0 and 1 hold the extremes, the last row is changed anyway
    assert float(ordinary.min()) >= 0.5 - 5 * math.sqrt(0.25 / draws)  # each ≥ 1/2, up to sampling error
    assert float((1 - ordinary.mean()) ** 7) < 0.01  # 7 checked batches holding the record: > 99 %
