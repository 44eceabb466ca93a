"""The run-time checks' dry passes leave no trace (issue #37, goal 1): the dry pass is
``checks/user_step.py``, the state it puts back ``checks/snapshot.py``.

The mixing check runs the user's ``training_step`` itself, on the sampled batch and on that batch with
examples removed or replaced. With the checks on (the default, or every step) and off, the same program
must end with the same Python state and the same weights. How a check changes the batch is
tests/checks/test_batch_edit.py.
"""

from __future__ import annotations

import copy
import random
from collections import deque
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from conftest import TinyModule, make_trainer
from lightning.pytorch import seed_everything
from torch import Tensor, nn

from lightning_dp import DPIS, DPStrategy
from lightning_dp.checks.snapshot import ModuleState

# -- the dry passes leave no trace ----------------------------------------------------------------------


class Tally(nn.Module):
    """A submodule with Python state of its own: a call counter and a set of the batch sizes it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.sizes: set[int] = set()

    def forward(self, h: Tensor) -> Tensor:
        self.calls += 1
        self.sizes.add(h.shape[0])
        return h


class Scheduling(TinyModule):
    """Counts its own steps and schedules on the count, as users do: the loss switches at call 20, the learning
    rate halves every 10th call, the inputs get noise from a generator of its own; lists, a dict, a tensor
    counter and a submodule's counter record every call. None of it tests ``checking()``."""

    def __init__(self) -> None:
        super().__init__(n=192, batch_size=16)
        self.tally = Tally()
        self.calls = 0
        self.history: list[tuple[int, int]] = []
        self.stats: dict[str, Any] = {"rows": 0, "losses": []}
        self.ticks = torch.zeros(())
        self.noise = torch.Generator().manual_seed(1)
        self.py_random = random.Random(2)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        self.calls += 1
        self.ticks += 1
        self.history.append((self.calls, len(x)))
        self.stats["rows"] += len(x)
        if self.calls % 10 == 0:
            for group in self.trainer.optimizers[0].param_groups:
                group["lr"] *= 0.5
        x = x + 0.01 * torch.randn(x.shape, generator=self.noise) * self.py_random.random()
        out = self.net[2](self.tally(self.net[1](self.net[0](x))))
        loss = F.cross_entropy(out, y) if self.calls < 20 else F.multi_margin_loss(out, y)
        self.stats["losses"].append(float(loss.detach()))
        return loss


def _fit_scheduling(template: Scheduling, check_sensitivity: Any) -> Scheduling:
    seed_everything(0, verbose=False)
    module = copy.deepcopy(template)
    strategy = DPStrategy(
        noise_multiplier=1.0, max_grad_norm=1.0, seed=0, check_sensitivity=check_sensitivity
    )
    make_trainer(strategy, max_epochs=2).fit(module)
    assert strategy.engine.steps > 20
    return module


def test_the_checks_leave_the_users_state_and_weights_as_without_them():
    """Same counters, lists, dicts, sets, tensor counter, learning rate and weights (bit for bit) with the
    checks off, at their default and on every step: the user's schedule sees real steps only."""
    template = Scheduling()
    runs = [_fit_scheduling(template, setting) for setting in (False, True, "every_step")]
    off = runs[0]
    assert off.calls == len(off.history) == off.tally.calls > 20  # one call per non-empty sampled batch
    assert off.stats["rows"] == sum(rows for _, rows in off.history)
    for other in runs[1:]:
        assert other.calls == off.calls
        assert other.history == off.history
        assert other.stats == off.stats
        assert other.tally.calls == off.tally.calls
        assert other.tally.sizes == off.tally.sizes
        assert torch.equal(other.ticks, off.ticks)
        assert torch.equal(other.noise.get_state(), off.noise.get_state())
        assert other.py_random.getstate() == off.py_random.getstate()
        assert (
            other.trainer.optimizers[0].param_groups[0]["lr"]
            == off.trainer.optimizers[0].param_groups[0]["lr"]
        )
        for (name, a), b in zip(off.state_dict().items(), other.state_dict().values(), strict=True):
            assert torch.equal(a, b), name


class CountingCalls(TinyModule):
    def __init__(self) -> None:
        super().__init__(n=200, batch_size=10)
        self.calls = 0

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.calls += 1
        return F.cross_entropy(self(batch[0]), batch[1])


def test_dpis_norm_pass_leaves_the_users_counters_as_they_were():
    """DPIS runs training_step over the candidates to read their norms: a dry pass too, so a counter kept in
    training_step counts the steps that reached it (one per non-empty sampled batch)."""
    module = CountingCalls()
    strategy = DPStrategy(sampler=DPIS(k=3, seed=0), seed=0, max_grad_norm=0.5, noise_multiplier=1.0)
    make_trainer(strategy, max_steps=6).fit(module)
    assert strategy.engine.steps == 6
    assert 0 < module.calls <= 6


class Notebook:
    """A plain object of the user's, held by the module."""

    def __init__(self) -> None:
        self.pages: list[str] = ["first"]
        self.count = 0


def test_a_snapshot_puts_python_state_back_in_place():
    """Lists, dicts, sets, deques, objects, arrays, tensors and generators return to their saved contents,
    as the same objects (a reference the user holds elsewhere sees the old contents again)."""
    module = Scheduling()
    module.book = Notebook()
    module.queue = deque([1, 2], maxlen=4)
    module.array = np.zeros(3)
    module.removed_later = "kept"
    history, book, stats = module.history, module.book, module.stats
    state = ModuleState.save(module, torch.device("cpu"))
    module.calls += 5
    module.history.append((1, 2))
    module.stats["losses"].append(0.5)
    module.stats["new"] = 1
    module.book.pages.append("dry")
    module.book.count += 1
    module.queue.append(3)
    module.array[0] = 7.0
    module.ticks += 1
    module.tally.sizes.add(99)
    module.added = [1]
    del module.removed_later
    torch.randn(2, generator=module.noise)
    assert state.drew_random_numbers()
    state.restore()
    assert module.calls == 0
    assert module.history is history
    assert history == []
    assert module.stats is stats
    assert stats == {"rows": 0, "losses": []}
    assert module.book is book
    assert book.pages == ["first"]
    assert book.count == 0
    assert list(module.queue) == [1, 2]
    assert module.array.tolist() == [0.0, 0.0, 0.0]
    assert float(module.ticks) == 0.0
    assert module.tally.sizes == set()
    assert not hasattr(module, "added")
    assert module.removed_later == "kept"
    assert not state.drew_random_numbers()
