"""The checks cover the computation the real step makes (issue #47, review items A2 and A4): in the run's own
reduced precision, and in the hooks that run inside the optimizer step.

Each leak trains through the Trainer with the defaults a user gets and is refused before the release it
would break; each control (ordinary code that reads no other example) trains.
"""

from __future__ import annotations

import copy
import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import grad_norm
from torch import Tensor, nn

from lightning_dp import DPStrategy
from tests.checks.test_edges import Classifier, data, fit, refused

pytestmark = pytest.mark.filterwarnings("ignore")

PATH = "the two made different torch operations"

# -- A2. a step that computes something else in reduced precision ------------------------------------------


def _reduced(x: Tensor, module: Classifier, branch: str) -> bool:
    """Whether the step is in reduced precision, read the way ``branch`` reads it."""
    if branch == "tensor":
        return x.dtype == torch.bfloat16
    if branch == "autocast":
        return torch.is_autocast_enabled(x.device.type)
    if branch == "self_dtype":
        return module.dtype != torch.float32
    return torch.get_default_dtype() != torch.float32


class Branching(Classifier):
    """Centres the hidden layer by the batch's mean, only in reduced precision (the fp32 path is exact)."""

    def __init__(self, branch: str) -> None:
        super().__init__()
        self.branch = branch

    def forward(self, x: Tensor) -> Tensor:
        h = self.l1(x)
        if _reduced(h, self, self.branch):
            h = h - h.mean(0)
        return self.l2(torch.relu(h))


class SmoothedInBf16(Classifier):
    """Label smoothing towards the batch's class frequencies in bf16 only: a small move per example."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        target = F.one_hot(y, 3).float()
        if logits.dtype == torch.bfloat16:
            target = 0.97 * target + 0.03 * torch.bincount(y, minlength=3).float() / len(y)
        return -(target * F.log_softmax(logits.float(), 1)).sum(1).mean()


@pytest.mark.parametrize(
    ("branch", "precision"),
    [
        ("tensor", "bf16-mixed"),
        ("autocast", "bf16-mixed"),
        ("tensor", "bf16-true"),
        ("self_dtype", "bf16-true"),
        ("default_dtype", "bf16-true"),
    ],
)
def test_a_step_that_branches_on_the_precision_is_refused_before_its_first_release(branch, precision):
    message = refused(Branching(branch), data(24), 24, PATH, precision=precision)
    assert "24" not in message


class ShiftInReducedPrecision(Callback):
    """A per-batch hook that computes the batch's mean only where the module is in bf16."""

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        x = batch[0]
        reduced = module.dtype != torch.float32
        module.shift = x.mean(0) if reduced else torch.zeros(x.shape[1], dtype=x.dtype)


class Shifted(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x - self.shift.to(x.dtype)), y)


def test_a_per_batch_hook_that_branches_on_the_precision_is_refused():
    callbacks = [ShiftInReducedPrecision()]
    refused(Shifted(), data(24), 24, PATH, precision="bf16-true", callbacks=callbacks)


def test_a_small_branch_at_a_large_batch_is_refused_too():
    refused(SmoothedInBf16(), data(1024), 1024, PATH, max_steps=1, precision="bf16-mixed")


def test_the_branch_moves_the_released_sum_by_more_than_c_and_its_fp32_path_does_not(neighbour):
    """What the refusal prevents, shown by the neighbour test with the check off."""

    def unchecked() -> DPStrategy:
        return DPStrategy(noise_multiplier=0.0, max_grad_norm=1e-3, check_sensitivity=False)

    torch.manual_seed(0)
    module, dataset = Branching("tensor"), data(16, outlier=True)
    outlier = int(dataset.tensors[0][:, 0].argmax())  # its removal moves the batch's mean most
    bf16 = neighbour.neighbour_move(module, dataset, unchecked, removed=outlier, precision="bf16-mixed")
    assert bf16.l2 > 1.2 * bf16.max_grad_norm
    neighbour.assert_neighbour_bound(neighbour.neighbour_move(module, dataset, unchecked, removed=outlier))


class CastsToSelfDtype(Classifier):
    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.to(self.dtype))


class UpcastsInReducedPrecision(Classifier):
    """Computes the hidden activation in fp32 where the run is in bf16: a cast, the same computation."""

    def forward(self, x: Tensor) -> Tensor:
        h = self.l1(x)
        if h.dtype != torch.float32:
            h = h.float()
        return self.l2(torch.relu(h).to(self.l2.weight.dtype))


class WithDropout(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.3)

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(self.drop(torch.relu(self.l1(x)) + 0.1 * torch.randn(x.shape[0], 8)))


class ManualWithStepHooks(Classifier):
    """Manual optimization, with hooks around its backward that only read (not part of the traced step)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        optimizer.step()

    def on_before_backward(self, loss: Tensor) -> None:
        self.finite = bool(torch.isfinite(loss))

    def on_after_backward(self) -> None:
        self.finite = self.finite and bool(torch.isfinite(self.l1.weight.grad).all())


MODELS = [Classifier, CastsToSelfDtype, UpcastsInReducedPrecision, WithDropout, ManualWithStepHooks]


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
@pytest.mark.parametrize("b", [8, 1024])
@pytest.mark.parametrize("model", MODELS)
def test_ordinary_models_train_in_reduced_precision(model, b, precision):
    assert fit(model(), data(b), b, max_steps=1, precision=precision).checks.mixing.checked_steps == [0]


# -- A4. hooks inside the optimizer step ---------------------------------------------------------------------

STEP_HOOK = "were written inside the optimizer step by"


class Watched(Classifier):
    """A buffer and a frozen copy of a layer, for the hooks below to write into."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(3))
        self.teacher = nn.Linear(8, 3).requires_grad_(False)


class BufferFromGradient(Watched):
    def on_after_backward(self) -> None:
        with torch.no_grad():
            self.seen.copy_(self.l2.bias.grad)


class TeacherFromGradient(Watched):
    def on_after_backward(self) -> None:
        with torch.no_grad():
            self.teacher.bias.copy_(self.l2.bias.grad)


class StashedThenWritten(Watched):
    """Keeps the non-private gradient on ``self``, writes it into the model once the release is made."""

    def on_after_backward(self) -> None:
        self.stash = self.l2.bias.grad.clone()

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        with torch.no_grad():
            self.seen.copy_(self.stash)


class BatchKeptThenWritten(Watched):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self.kept = batch[0]
        return super().training_step(batch, batch_idx)

    def on_before_zero_grad(self, optimizer: Any) -> None:
        with torch.no_grad():
            self.seen.copy_(self.kept.mean(0)[:3])


class LossWritten(Watched):
    def on_before_backward(self, loss: Tensor) -> None:
        with torch.no_grad():
            self.seen.fill_(float(loss))


class StepFromGradientNorm(Watched):
    """Sets the learning rate from the non-private gradient's norm."""

    def on_after_backward(self) -> None:
        norm = float(torch.cat([p.grad.flatten() for p in self.parameters() if p.grad is not None]).norm())
        self.trainer.optimizers[0].param_groups[0]["lr"] = 0.1 / (1.0 + norm)


class OwnBackward(Watched):
    """Lightning calls the module's ``backward``: the gradient it leaves is the batch's, before the noise."""

    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        loss.backward(*args, **kwargs)
        with torch.no_grad():
            self.seen.copy_(self.l2.bias.grad)


class StatisticsObject(Watched):
    """Keeps the gradient's norm on an object of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.stats = types.SimpleNamespace(norm=0.0)

    def on_after_backward(self) -> None:
        self.stats.norm = float(self.l2.bias.grad.norm())


class CopiesGradient(Callback):
    """A callback's own module, written from the non-private gradient."""

    def __init__(self) -> None:
        self.copy = nn.Linear(8, 3)

    def on_after_backward(self, trainer: Any, module: Any) -> None:
        with torch.no_grad():
            self.copy.bias.copy_(module.l2.bias.grad)


class BufferFromGradientByCallback(Callback):
    def on_after_backward(self, trainer: Any, module: Any) -> None:
        with torch.no_grad():
            module.seen.copy_(module.l2.bias.grad)


@pytest.mark.parametrize(
    ("model", "callback", "written"),
    [
        (BufferFromGradient, None, "seen"),
        (TeacherFromGradient, None, "teacher.bias"),
        (StashedThenWritten, None, "StashedThenWritten.stash"),
        (BatchKeptThenWritten, None, "seen"),
        (LossWritten, None, "seen"),
        (StepFromGradientNorm, None, "optimizer 0 group 0 lr"),
        (OwnBackward, None, "seen"),
        (StatisticsObject, None, "StatisticsObject.stats"),
        (Watched, CopiesGradient, "CopiesGradient.copy.bias"),
        (Watched, BufferFromGradientByCallback, "seen"),
    ],
)
def test_a_step_hook_that_writes_private_data_is_refused_before_the_first_release(model, callback, written):
    callbacks = [callback()] if callback is not None else []
    message = refused(model(), data(24), 24, STEP_HOOK, callbacks=callbacks)
    assert repr(written) in message
    assert "24" not in message


def test_what_on_after_backward_writes_is_the_gradient_without_noise():
    """Why: with the check off, the buffer holds the batch's own gradient however much noise the release has."""
    torch.manual_seed(0)
    module, dataset = BufferFromGradient(), data(16)
    x, y = dataset.tensors
    reference = BufferFromGradient()
    reference.load_state_dict(module.state_dict())
    expected = torch.autograd.grad(F.cross_entropy(reference(x), y), reference.l2.bias)[0]
    fit(module, dataset, 16, max_steps=1, dp={"noise_multiplier": 10.0, "check_sensitivity": False})
    torch.testing.assert_close(module.seen, expected, rtol=1e-4, atol=1e-6)


class LogsReleasedNorms(Watched):
    """The common correct uses: the released gradient's norms logged, and kept in a buffer."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        norms = grad_norm(self, norm_type=2)
        self.log_dict(norms)
        with torch.no_grad():
            self.seen.fill_(float(norms["grad_2.0_norm_total"]))


class Reads(Callback):
    """Counts the hooks' calls, checks the gradients are finite and clips them (the release replaces them)."""

    def __init__(self) -> None:
        self.calls = 0

    def on_after_backward(self, trainer: Any, module: Any) -> None:
        self.calls += 1
        assert all(torch.isfinite(p.grad).all() for p in module.parameters() if p.grad is not None)
        nn.utils.clip_grad_norm_(module.parameters(), 1.0)

    def on_before_zero_grad(self, trainer: Any, module: Any, optimizer: Any) -> None:
        self.calls += 1


@pytest.mark.parametrize("b", [8, 1024])
def test_hooks_that_read_or_use_the_released_gradient_train(b, tmp_path):
    reads = Reads()
    callbacks = [reads, LearningRateMonitor()]
    logger = CSVLogger(tmp_path)
    strategy = fit(
        LogsReleasedNorms(),
        data(2 * b),
        b,
        callbacks=callbacks,
        logger=logger,
        dp={"check_sensitivity": "every_step"},
    )
    assert strategy.checks.mixing.checked_steps == [0, 1]
    assert reads.calls == 4  # the real steps' calls only: the checks' passes leave no trace


class EMA(Callback):
    """An EMA of the weights in a module the callback holds, updated in ``hook`` (post-processing)."""

    def __init__(self, hook: str) -> None:
        self.hook = hook
        self.ema: nn.Module | None = None

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        self.ema = copy.deepcopy(module.l1).requires_grad_(False)

    def _update(self, module: Any) -> None:
        assert self.ema is not None
        with torch.no_grad():
            for e, p in zip(self.ema.parameters(), module.l1.parameters(), strict=True):
                e.mul_(0.5).add_(0.5 * p)

    def on_before_zero_grad(self, trainer: Any, module: Any, optimizer: Any) -> None:
        if self.hook == "on_before_zero_grad":
            self._update(module)

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        if self.hook == "on_train_batch_end":
            self._update(module)


@pytest.mark.parametrize("hook", ["on_before_zero_grad", "on_train_batch_end"])
def test_an_ema_a_callback_holds_trains_as_without_the_checks(hook):
    emas = []
    for setting in ("every_step", False):
        torch.manual_seed(0)
        ema = EMA(hook)
        fit(Classifier(), data(64), 16, max_steps=3, callbacks=[ema], dp={"check_sensitivity": setting})
        assert ema.ema is not None
        emas.append(ema.ema.weight.clone())
    assert torch.equal(*emas)
