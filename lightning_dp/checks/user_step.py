"""Running the user's ``training_step`` as a dry pass: nothing logged, stepped, released or left behind.

The checks (and DPIS's norm pass) run the user's own step on a batch to read per-example gradients.
A dry pass detaches ``self.log``; under manual optimization it also gives ``training_step`` optimizers and
schedulers whose ``step`` does nothing and a ``manual_backward`` that only backpropagates, so the loop's
counters, the optimizer state and the ledger never see it. :class:`ModuleState` puts back what the pass
touched: ``.grad``, buffers (values, and objects the forward replaced), the global random streams, and the
Python state of the module and its submodules (:class:`PythonState`: counters, lists, dicts, sets, the
user's own generators), so the same program trains the same with the checks on or off.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import operator
import random
import sys
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping
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


def training_step_loss(
    module: LightningModule, batch: Any, batch_idx: int = 0, keep_python_state: bool = True
) -> Tensor | None:
    """The loss ``module.training_step(batch, batch_idx)`` returns, with logging detached (None when it
    returns no loss: None, or a dict without ``"loss"``, which the real step reports in Lightning's words).

    ``keep_python_state``: put the module tree's Python state back after the call (:class:`PythonState`:
    DPIS's norm pass); off where the caller's :class:`ModuleState` does it (and reads the draws first)."""
    saved = PythonState.save(module, _optimizer_settings(module)) if keep_python_state else None
    try:
        with _detached_logging(module), warnings.catch_warnings(), _dry():
            warnings.simplefilter("ignore")
            out = module.training_step(batch, batch_idx)
    finally:
        if saved is not None:
            saved.restore()
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
            result.loss = training_step_loss(module, batch, batch_idx, keep_python_state=False)
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
        result.loss = training_step_loss(module, batch, batch_idx, keep_python_state=False)
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


TENSOR_COPY_BYTES = 16 * 2**20
"""Tensor and array attributes (not parameters or buffers) copied per snapshot, in bytes: larger ones (a data
set held on the module) are only watched, and one a dry pass writes in place is reported, not put back."""

MAX_OBJECTS = 20_000
"""Containers and objects followed per snapshot; state beyond them (a huge nested structure) is not saved."""

_FOREIGN = frozenset({"torch", "lightning", "pytorch_lightning", "lightning_fabric", "lightning_dp", "numpy"})
"""Packages whose objects are never walked into (a Trainer, a DataLoader, torch internals)."""

_ATOMS = (str, bytes, int, float, complex, bool, type(None), range, slice, enum.Enum)

_ATOM_TYPES = frozenset({str, bytes, int, float, bool, type(None)})
"""The exact types of most values in a large list (a fast test before ``isinstance``)."""

_reported: set[str] = set()


@functools.cache
def _internal_names() -> frozenset[str]:
    """The attributes torch and Lightning keep in every module's ``__dict__`` (hooks, the trainer, ...):
    theirs, not the user's, and restored by their own owners (``_modules`` is saved on its own)."""
    return frozenset(set(LightningModule().__dict__) - {"training"})


def _walked(value: Any) -> bool:
    """An object of the user's (or a third party's) whose ``__dict__`` is followed: not a class, a function,
    a module, or an object of torch, Lightning, NumPy or the standard library."""
    kind = type(value)
    root = kind.__module__.partition(".")[0]
    return (
        hasattr(value, "__dict__")
        and isinstance(getattr(value, "__dict__", None), dict)
        and root not in _FOREIGN
        and root not in sys.stdlib_module_names
        and root != "__builtin__"
    )


@dataclass
class PythonState:
    """The Python state of a module tree, saved so a dry pass can be undone: each module's ``__dict__``
    (the user's attributes: numbers, strings, lists, dicts, sets, objects) and everything those reach.

    Containers are put back *in place* (a list the user also holds elsewhere is the same list, with its old
    items), so nothing is copied but references; tensors and arrays that are not parameters or buffers are
    copied up to :data:`TENSOR_COPY_BYTES` and written back when a pass wrote them in place; the user's own
    generators (``torch.Generator``, ``random.Random``, NumPy's) get their states back. Not covered: state
    outside the module (globals, closures, files, a logger), objects of torch/Lightning/NumPy classes other
    than tensors, arrays and generators, objects with ``__slots__``, and whatever lies beyond
    :data:`MAX_OBJECTS` objects; :func:`checking` is there for those."""

    undo: list[Callable[[], None]] = field(default_factory=list)
    watched: list[tuple[str, Tensor, int]] = field(default_factory=list)
    """Tensors too large to copy: (where, tensor, version at save)."""
    generators: list[tuple[Callable[[], Any], Any]] = field(default_factory=list)
    """The user's own generators: (read the state, the state at save)."""

    @classmethod
    def save(cls, module: nn.Module, settings: list[dict[str, Any]] | None = None) -> PythonState:
        """``settings``: further dicts put back shallowly (the optimizers' parameter groups: a step that
        sets or scales the learning rate on its own schedule must not do it in a dry pass)."""
        state = cls()
        for group in settings or []:
            state.undo.append(functools.partial(_refill_dict, group, dict(group)))
        skip = {id(t) for t in module.parameters()} | {id(t) for t in module.buffers()}
        modules = list(module.named_modules(remove_duplicate=True))
        seen = {id(m) for _, m in modules} | skip
        budget = [MAX_OBJECTS, TENSOR_COPY_BYTES]
        internal = _internal_names()
        for name, m in modules:
            attributes = {
                k: v for k, v in m.__dict__.items() if k not in internal and not k.startswith("_dp_")
            }
            state.undo.append(functools.partial(_restore_attributes, m, attributes, dict(m._modules)))
            for key, value in attributes.items():
                state._visit(value, f"{name or 'self'}.{key}", seen, budget)
        return state

    def _visit(self, value: Any, where: str, seen: set[int], budget: list[int]) -> None:
        stack = [(value, where)]
        while stack:
            x, at = stack.pop()
            if isinstance(x, _ATOMS) or id(x) in seen:
                continue
            seen.add(id(x))
            if isinstance(x, Tensor):
                self._tensor(x, at, budget)
                continue
            if budget[0] <= 0:
                continue
            budget[0] -= 1
            children: Any = ()
            if isinstance(x, list):
                self.undo.append(functools.partial(_refill_list, x, list(x)))
                children = x
            elif isinstance(x, dict):
                self.undo.append(functools.partial(_refill_dict, x, dict(x)))
                children = x.values()
            elif isinstance(x, set):
                self.undo.append(functools.partial(_refill_set, x, set(x)))
                children = x
            elif isinstance(x, deque):
                self.undo.append(functools.partial(_refill_deque, x, list(x)))
                children = x
            elif isinstance(x, bytearray):
                self.undo.append(functools.partial(_refill_list, x, bytearray(x)))
            elif isinstance(x, tuple | frozenset):
                children = x
            elif isinstance(x, torch.Generator):
                self._generator(x.get_state, x.set_state)
            elif isinstance(x, random.Random):
                self._generator(x.getstate, x.setstate)
            elif isinstance(x, np.random.Generator):
                bits = x.bit_generator
                self._generator(
                    functools.partial(getattr, bits, "state"), functools.partial(setattr, bits, "state")
                )
            elif isinstance(x, np.random.RandomState):
                self._generator(x.get_state, x.set_state)
            elif isinstance(x, np.ndarray):
                if x.dtype != object and x.nbytes <= budget[1]:
                    budget[1] -= x.nbytes
                    self.undo.append(functools.partial(_refill_array, x, x.copy()))
            elif _walked(x):
                self.undo.append(functools.partial(_refill_dict, x.__dict__, dict(x.__dict__)))
                children = x.__dict__.values()
            inner = f"{at}[…]"
            stack.extend(
                (c, inner) for c in children if type(c) not in _ATOM_TYPES and not isinstance(c, _ATOMS)
            )

    def _generator(self, read: Callable[[], Any], write: Callable[[Any], Any]) -> None:
        saved = read()
        self.undo.append(functools.partial(write, saved))
        self.generators.append((read, saved))

    def drew_random_numbers(self) -> bool:
        """Whether a generator of the user's (held by the module) was drawn from since :meth:`save`."""
        return any(not _same_state(read(), saved) for read, saved in self.generators)

    def _tensor(self, t: Tensor, where: str, budget: list[int]) -> None:
        if t.is_sparse or t.layout != torch.strided or t.is_meta or isinstance(t, nn.Parameter):
            return
        size = t.numel() * t.element_size()
        if size <= budget[1]:
            budget[1] -= size
            self.undo.append(functools.partial(_refill_tensor, t, t._version, t.detach().clone()))
        else:
            self.watched.append((where, t, t._version))

    def restore(self) -> None:
        """Put every saved attribute, container, tensor and generator back as it was at :meth:`save`."""
        for undo in self.undo:
            undo()
        for where, t, version in self.watched:
            if t._version != version and where not in _reported:
                _reported.add(where)
                warnings.warn(
                    f"lightning-dp's run-time checks ran training_step, which wrote the tensor {where} in place; "
                    f"it is larger than {TENSOR_COPY_BYTES // 2**20} MiB, so the check did not copy it and "
                    "cannot put it back: the real step sees it written once more. Skip the write while "
                    "lightning_dp.checking() is True.",
                    UserWarning,
                    stacklevel=2,
                )


def _same_state(a: Any, b: Any) -> bool:
    """Equal generator states (tensors, NumPy arrays, and dicts or tuples of them and of numbers)."""
    if isinstance(a, Tensor):
        return isinstance(b, Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, tuple | list):
        return (
            isinstance(b, tuple | list)
            and len(a) == len(b)
            and all(_same_state(x, y) for x, y in zip(a, b, strict=True))
        )
    return bool(a == b)


def _optimizer_settings(module: nn.Module) -> list[dict[str, Any]]:
    """The parameter groups of the optimizers the module's trainer steps (lr, momentum, ...), if any."""
    trainer = getattr(module, "_trainer", None)
    try:
        optimizers = list(trainer.optimizers) if trainer is not None else []
    except Exception:  # no strategy or optimizers yet
        return []
    return [g for o in optimizers for g in getattr(o, "param_groups", []) if isinstance(g, dict)]


def _restore_attributes(module: nn.Module, attributes: dict[str, Any], modules: dict[str, Any]) -> None:
    internal = _internal_names()
    for key in [k for k in module.__dict__ if k not in internal and not k.startswith("_dp_")]:
        if key not in attributes:
            del module.__dict__[key]
    for key, value in attributes.items():
        if module.__dict__.get(key, _MISSING) is not value:
            module.__dict__[key] = value
    if module._modules != modules:
        module._modules.clear()
        module._modules.update(modules)


_MISSING = object()


def _refill_list(x: list[Any] | bytearray, items: Any) -> None:
    if len(x) != len(items) or not all(map(operator.is_, x, items)):
        x[:] = items


def _refill_dict(x: dict[Any, Any], items: dict[Any, Any]) -> None:
    if len(x) != len(items) or any(items.get(k, _MISSING) is not v for k, v in x.items()):
        x.clear()
        x.update(items)


def _refill_set(x: set[Any], items: set[Any]) -> None:
    if x != items:
        x.clear()
        x.update(items)


def _refill_deque(x: deque[Any], items: list[Any]) -> None:
    if len(x) != len(items) or not all(map(operator.is_, x, items)):
        x.clear()
        x.extend(items)


def _refill_array(x: np.ndarray, values: np.ndarray) -> None:
    if not np.array_equal(x, values, equal_nan=x.dtype.kind in "fc"):
        x[...] = values


def _refill_tensor(t: Tensor, version: int, values: Tensor) -> None:
    if t._version != version:
        with torch.no_grad():
            t.copy_(values)


@dataclass
class ModuleState:
    """Everything a dry pass may touch, saved so it can be put back exactly: the global random streams,
    each parameter's ``.grad``, each buffer (the object and its values) and the module tree's Python state
    (:class:`PythonState`). Parameters themselves are only watched: a pass that writes one in place is
    reported by :meth:`written_parameters`."""

    module: nn.Module
    rng: GlobalRNG
    random_state: tuple[Any, ...] = ()
    grads: list[tuple[nn.Parameter, Tensor | None]] = field(default_factory=list)
    buffers: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    param_versions: dict[str, tuple[int, int]] = field(default_factory=dict)
    python: PythonState = field(default_factory=PythonState)

    @classmethod
    def save(cls, module: nn.Module, device: torch.device) -> ModuleState:
        state = cls(module, GlobalRNG(device))
        state.random_state = state.rng.state()
        state.grads = [(p, p.grad) for p in module.parameters()]
        state.buffers = {n: (b, b.detach().clone()) for n, b in module.named_buffers()}
        state.param_versions = {n: (id(p), p._version) for n, p in module.named_parameters()}
        state.python = PythonState.save(module, _optimizer_settings(module))
        return state

    def drew_random_numbers(self) -> bool:
        """Whether the pass drew from the global random streams or from a generator the module holds."""
        return not self.rng.same(self.random_state, self.rng.state()) or self.python.drew_random_numbers()

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
        """Put the random streams, ``.grad``, the buffers and the Python state back as at :meth:`save`."""
        self.python.restore()
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
