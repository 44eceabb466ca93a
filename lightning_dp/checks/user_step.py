"""Running the user's ``training_step`` as a dry pass: nothing logged, stepped, released or left behind.

The checks (and DPIS's norm pass) run the user's own step on a batch to read per-example gradients.
A dry pass detaches ``self.log``; under manual optimization it also gives ``training_step`` optimizers and
schedulers whose ``step`` does nothing and a ``manual_backward`` that only backpropagates, so the loop's
counters, the optimizer state and the ledger never see it. :class:`ModuleState` puts back what the pass
touched: ``.grad``, buffers (values, and objects the forward replaced) and the global random streams.
"""

from __future__ import annotations

import contextlib
import random
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn

_dry_passes = 0


def checking() -> bool:
    """True while lightning-dp runs your ``training_step`` itself, for a check or a probe (a dry pass:
    nothing is logged, stepped or released). Test it to keep your own counters and lists to real steps:
    ``if not lightning_dp.checking(): self.seen.append(len(x))``."""
    return _dry_passes > 0


@contextlib.contextmanager
def _dry() -> Iterator[None]:
    global _dry_passes
    _dry_passes += 1
    try:
        yield
    finally:
        _dry_passes -= 1


def training_step_loss(module: LightningModule, batch: Any, batch_idx: int = 0) -> Tensor | None:
    """The loss ``module.training_step(batch, batch_idx)`` returns, with logging detached (None when it
    returns no loss: None, or a dict without ``"loss"``, which the real step reports in Lightning's words)."""
    with _detached_logging(module), warnings.catch_warnings(), _dry():
        warnings.simplefilter("ignore")
        out = module.training_step(batch, batch_idx)
    loss = out.get("loss") if isinstance(out, Mapping) else out
    return loss if isinstance(loss, Tensor) else None


@contextlib.contextmanager
def _detached_logging(module: LightningModule) -> Iterator[None]:
    with _shadowed(module, log=_no_op, log_dict=_no_op):
        yield


@contextlib.contextmanager
def _shadowed(module: nn.Module, **attributes: Any) -> Iterator[None]:
    """Instance attributes that shadow ``module``'s methods for the block (the class is untouched)."""
    saved = {name: module.__dict__[name] for name in attributes if name in module.__dict__}
    module.__dict__.update(attributes)
    try:
        yield
    finally:
        for name in attributes:
            if name in saved:
                module.__dict__[name] = saved[name]
            else:
                module.__dict__.pop(name, None)


def _no_op(*args: Any, **kwargs: Any) -> None:
    del args, kwargs


class _DryOptimizer:
    """What ``self.optimizers()`` returns in a dry pass: ``zero_grad`` and ``step`` move nothing; a closure
    given to ``step`` still runs once (it computes the loss and backpropagates)."""

    def __init__(self, optimizer: Any) -> None:
        self._optimizer = optimizer

    def zero_grad(self, set_to_none: bool = True) -> None:
        del set_to_none

    def step(self, closure: Any = None, **kwargs: Any) -> Any:
        del kwargs
        return closure() if closure is not None else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


class _DryScheduler:
    def __init__(self, scheduler: Any) -> None:
        self._scheduler = scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)


@dataclass
class DryPass:
    """One dry run of ``training_step``: its loss (automatic optimization) and how many backward passes
    it made itself (manual optimization)."""

    loss: Tensor | None = None
    backward_calls: int = 0

    @property
    def backpropagated(self) -> bool:
        return self.backward_calls > 0


def dry_training_step(
    module: LightningModule, batch: Any, batch_idx: int, precision: Any, forward_only: bool = False
) -> DryPass:
    """Run ``training_step`` once without side effects on training; backpropagate its loss (automatic
    optimization: here, outside the precision context as Lightning does; manual: ``manual_backward``),
    unless ``forward_only``."""
    result = DryPass()

    def manual_backward(loss: Tensor, *args: Any, **kwargs: Any) -> None:
        result.backward_calls += 1
        if not forward_only:
            loss.backward(*args, **kwargs)

    if module.automatic_optimization:
        with precision.train_step_context():
            result.loss = training_step_loss(module, batch, batch_idx)
        if forward_only:
            return result
        if result.loss is not None and result.loss.requires_grad:
            result.loss.backward()
            result.backward_calls = 1
        return result
    optimizers = module.optimizers()
    schedulers = module.lr_schedulers()
    dry_optimizers: Any = (
        [_DryOptimizer(o) for o in optimizers] if isinstance(optimizers, list) else _DryOptimizer(optimizers)
    )
    dry_schedulers: Any = (
        [_DryScheduler(s) for s in schedulers]
        if isinstance(schedulers, list)
        else (None if schedulers is None else _DryScheduler(schedulers))
    )
    with (
        _shadowed(
            module,
            optimizers=lambda use_pl_optimizer=True: dry_optimizers,
            lr_schedulers=lambda: dry_schedulers,
            manual_backward=manual_backward,
        ),
        precision.train_step_context(),
    ):
        result.loss = training_step_loss(module, batch, batch_idx)
    return result


class GlobalRNG:
    """The global random streams user code may draw from: torch (CPU, and CUDA on a CUDA device),
    Python's ``random`` and NumPy's."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda" and torch.cuda.is_available()

    def state(self) -> tuple[Any, ...]:
        cuda = torch.cuda.get_rng_state_all() if self.cuda else []
        return torch.get_rng_state(), cuda, random.getstate(), np.random.get_state()

    def restore(self, state: tuple[Any, ...]) -> None:
        torch.set_rng_state(state[0])
        if self.cuda:
            torch.cuda.set_rng_state_all(state[1])
        random.setstate(state[2])
        np.random.set_state(state[3])

    @staticmethod
    def same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
        """Whether nothing was drawn between the two states."""
        return (
            torch.equal(a[0], b[0])
            and all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))
            and a[2] == b[2]
            and all(np.array_equal(x, y) for x, y in zip(a[3], b[3], strict=True))
        )


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    module_name, _, leaf = name.rpartition(".")
    return (root.get_submodule(module_name) if module_name else root), leaf


def same_values(a: Tensor, b: Tensor) -> bool:
    """Equal shape, dtype and values (NaN equal to NaN: a constant NaN entry is not a change)."""
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and bool(
            torch.equal(a, b)
            or (torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan()))
        )
    )


@dataclass
class ModuleState:
    """Everything a dry pass may touch, saved so it can be put back exactly: the global random streams,
    each parameter's ``.grad``, and each buffer (the object and its values). Parameters themselves are
    only watched: a pass that writes one in place is reported by :meth:`written_parameters`."""

    module: nn.Module
    rng: GlobalRNG
    random_state: tuple[Any, ...] = ()
    grads: list[tuple[nn.Parameter, Tensor | None]] = field(default_factory=list)
    buffers: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    param_versions: dict[str, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def save(cls, module: nn.Module, device: torch.device) -> ModuleState:
        state = cls(module, GlobalRNG(device))
        state.random_state = state.rng.state()
        state.grads = [(p, p.grad) for p in module.parameters()]
        state.buffers = {n: (b, b.detach().clone()) for n, b in module.named_buffers()}
        state.param_versions = {n: (id(p), p._version) for n, p in module.named_parameters()}
        return state

    def drew_random_numbers(self) -> bool:
        return not self.rng.same(self.random_state, self.rng.state())

    def written_buffers(self) -> dict[str, Tensor]:
        """The buffers whose value changed since :meth:`save` (new values, cloned), by name."""
        out = {}
        for name, current in self.module.named_buffers():
            saved = self.buffers.get(name)
            if saved is None or not same_values(saved[1], current.detach()):
                out[name] = current.detach().clone()
        return out

    def written_parameters(self) -> list[str]:
        """Parameters written in place (or replaced) since :meth:`save`."""
        now = {n: (id(p), p._version) for n, p in self.module.named_parameters()}
        return [n for n, v in now.items() if self.param_versions.get(n) != v]

    def restore(self) -> None:
        """Put the random streams, ``.grad`` and the buffers back as they were at :meth:`save`."""
        self.rng.restore(self.random_state)
        for p, g in self.grads:
            p.grad = g
        with torch.no_grad():
            for name, (original, values) in self.buffers.items():
                owner, leaf = _owner(self.module, name)
                if owner._buffers.get(leaf) is not original:
                    owner._buffers[leaf] = original
                if not same_values(original, values):
                    original.copy_(values)
