"""The state snapshot and undo log of a dry pass (``checks/snapshot.py``), tested directly."""

from __future__ import annotations

import itertools
import random

import numpy as np
import torch
from torch import nn

from lightning_dp.checks.dry_flag import _dry
from lightning_dp.checks.snapshot import GlobalRNG, ModuleState, PythonState, ReplayingIterator


class _Stateful(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("seen", torch.zeros(2))
        self.count = 0
        self.history: list[int] = [1, 2]
        self.table = {"a": 1}
        self.tags = {"x"}
        self.stream = iter(range(100))


def _touch(module: _Stateful) -> None:
    """What a dry pass may do: write a buffer, a gradient, Python attributes, the random streams."""
    module.lin(torch.randn(4, 3)).sum().backward()
    module.seen.add_(1.0)
    module.count += 5
    module.history.append(3)
    module.table["b"] = 2
    module.tags.add("y")
    random.random()
    np.random.rand()


def test_module_state_puts_back_buffers_grads_python_state_and_the_random_streams() -> None:
    module = _Stateful()
    history = module.history
    state = ModuleState.save(module, torch.device("cpu"))
    expected = (torch.rand(2), random.random(), np.random.rand())
    state.rng.restore(state.random_state)
    _touch(module)
    assert state.drew_random_numbers()
    assert set(state.written_buffers()) == {"seen"}
    state.restore()
    assert torch.equal(module.seen, torch.zeros(2))
    assert all(p.grad is None for p in module.parameters())
    assert (module.count, module.table, module.tags) == (0, {"a": 1}, {"x"})
    assert module.history is history
    assert history == [1, 2]
    assert torch.equal(torch.rand(2), expected[0])
    assert random.random() == expected[1]
    assert np.random.rand() == expected[2]


def test_a_parameter_written_in_place_is_reported_not_hidden() -> None:
    module = _Stateful()
    state = ModuleState.save(module, torch.device("cpu"))
    assert state.written_parameters() == []
    with torch.no_grad():
        module.lin.weight.mul_(2.0)
    assert state.written_parameters() == ["lin.weight"]


def test_an_iterator_is_replayed_so_the_real_step_sees_the_items_a_dry_pass_drew() -> None:
    module = _Stateful()
    module.stream = itertools.count()
    python = PythonState.save(module)
    assert isinstance(module.stream, ReplayingIterator)
    with _dry():
        drawn = [next(module.stream), next(module.stream)]
    python.restore()
    with _dry():
        assert [next(module.stream), next(module.stream)] == drawn  # pass B: the same items
    python.restore()
    assert [next(module.stream) for _ in range(3)] == [0, 1, 2]  # the real step: as with the checks off


def test_the_global_streams_are_read_and_put_back_together() -> None:
    rng = GlobalRNG(torch.device("cpu"))
    saved = rng.state()
    first = (torch.rand(()), random.random(), np.random.rand())
    assert not GlobalRNG.same(saved, rng.state())
    rng.restore(saved)
    assert GlobalRNG.same(saved, rng.state())
    assert (torch.rand(()), random.random(), np.random.rand()) == first
