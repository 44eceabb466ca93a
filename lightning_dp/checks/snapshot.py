"""The state snapshot and undo log of a dry pass: what it may touch, saved so it can be put back exactly.

:class:`ModuleState` saves the global random streams, ``.grad``, buffers and, through :class:`PythonState`,
the Python state of the module tree, the user's callbacks and datamodule (counters, lists, dicts, sets, the
user's own generators; iterators and Python generators are replayed, not copied: :class:`ReplayingIterator`),
so the same program trains the same with the checks on or off. Over 500 lines: one undo log, whose walk,
copies and refills belong together.
"""

from __future__ import annotations

import enum
import functools
import io
import operator
import random
import sys
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from lightning_dp.checks.batch_hooks import _transfer_hook_owner
from lightning_dp.checks.dry_flag import checking
from lightning_dp.checks.integrity import TRANSFER_HOOKS


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


class ReplayingIterator:
    """An iterator or generator the module (or a callback) holds, as the dry passes leave it: it yields the
    items a dry pass drew from it first, then the iterator's own next items.

    An iterator cannot be copied and put back (a DataLoader iterator over public data, a Python generator, an
    ``itertools.count`` warmup). So when a dry pass starts, each one the module tree holds (an attribute, or an
    item of a list or dict it holds) is replaced by this proxy, for good: inside a dry pass it draws from the
    iterator and records each item; :meth:`PythonState.restore` rewinds it, so pass B and then the real step
    get exactly the items pass A drew, in order, and the iterator continues after them. Outside the passes it
    forgets each item it hands out. The program sees the same sequence of items as with the checks off; a
    draw that drew from the global random streams (a shuffled loader's first batch) moves them the same way
    when it is replayed from the state it was recorded in.

    ``next()`` and ``iter()`` work; other attributes are read from the wrapped iterator (``send``, ``throw``
    and ``close`` of a generator go to it directly, without replay; its own counters, such as a DataLoader
    iterator's, count the recorded items as drawn). Not preserved: its type (``isinstance`` against
    ``GeneratorType`` fails), ``len()``, pickling, and an iterator also held outside the module tree (a
    global: drawing from that reference skips the recording)."""

    def __init__(self, source: Iterator[Any]) -> None:
        self._source = source
        self._items: list[tuple[Any, tuple[Any, ...] | None, tuple[Any, ...] | None]] = []
        """(item, global random state before and after drawing it: None if the draw drew no random number)"""
        self._position = 0

    def __iter__(self) -> ReplayingIterator:
        return self

    def __next__(self) -> Any:
        if self._position < len(self._items):
            item, before, after = self._items[self._position]
            self._position += 1
            if before is not None and after is not None:  # a draw that drew random numbers (a shuffled
                rng = _process_rng()  # loader's first batch): replayed from the same state, it moves it too
                if GlobalRNG.same(rng.state(), before):
                    rng.restore(after)
        elif checking():
            rng = _process_rng()
            before = rng.state()
            item = next(self._source)
            after = rng.state()
            drew = not GlobalRNG.same(before, after)
            self._items.append((item, before if drew else None, after if drew else None))
            self._position += 1
        else:
            item = next(self._source)
        if self._position and not checking():  # handed to a real step: never replayed again
            del self._items[: self._position]
            self._position = 0
        return item

    def _rewind(self, position: int) -> None:
        self._position = min(position, len(self._items))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "_source" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["_source"], name)

    def __repr__(self) -> str:
        return (
            f"ReplayingIterator({self._source!r}, {len(self._items) - self._position} recorded items ahead)"
        )


def _process_rng() -> GlobalRNG:
    """The process's global random streams (CUDA's too once CUDA is in use)."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return GlobalRNG(torch.device("cuda" if cuda else "cpu"))


def _replayable(x: Any) -> bool:
    """An iterator whose state :class:`PythonState` cannot copy: a generator, an ``itertools`` or built-in
    iterator, a DataLoader's (an iterator object of the user's own class is walked and restored instead)."""
    return (
        isinstance(x, Iterator)
        and not isinstance(x, ReplayingIterator | io.IOBase | Tensor | nn.Module)
        and not _walked(x)
    )


def _replay_iterators(items: dict[Any, Any] | list[Any], proxies: dict[int, ReplayingIterator]) -> None:
    """Replace each iterator among the values of ``items`` by its :class:`ReplayingIterator` (one per iterator:
    the same iterator held twice gets the same proxy)."""
    pairs = list(items.items()) if isinstance(items, dict) else list(enumerate(items))
    for key, value in pairs:
        if _replayable(value):
            if id(value) not in proxies:
                proxies[id(value)] = ReplayingIterator(value)
            items[key] = proxies[id(value)]


@dataclass
class PythonState:
    """The Python state of a module tree, saved so a dry pass can be undone: each module's ``__dict__``
    (the user's attributes: numbers, strings, lists, dicts, sets, objects) and everything those reach.

    Containers are put back *in place* (a list the user also holds elsewhere is the same list, with its old
    items), so nothing is copied but references; tensors and arrays that are not parameters or buffers are
    copied up to :data:`TENSOR_COPY_BYTES` and written back when a pass wrote them in place; the user's own
    generators (``torch.Generator``, ``random.Random``, NumPy's) get their states back; the parameters and
    buffers of a module held outside the module tree (a callback's EMA copy) are copied like tensors;
    iterators and Python generators, which cannot be copied, are replaced by a :class:`ReplayingIterator`
    and rewound. Further
    objects (the user's callbacks and datamodule) are saved the same way. Not covered: state outside these
    (globals, closures, files, a logger), objects of torch/Lightning/NumPy classes other than tensors, arrays,
    generators and modules, objects with ``__slots__``, iterators held in tuples, sets or deques, and whatever lies
    beyond :data:`MAX_OBJECTS` objects; :func:`checking` is there for those."""

    undo: list[Callable[[], None]] = field(default_factory=list)
    watched: list[tuple[str, Tensor, int]] = field(default_factory=list)
    """Tensors too large to copy: (where, tensor, version at save)."""
    generators: list[tuple[Callable[[], Any], Any]] = field(default_factory=list)
    """The user's own generators: (read the state, the state at save)."""
    proxies: dict[int, ReplayingIterator] = field(default_factory=dict)
    """The iterators replaced by a :class:`ReplayingIterator` at save, by the id of the iterator."""

    @classmethod
    def save(
        cls, module: nn.Module, settings: list[dict[str, Any]] | None = None, objects: list[Any] | None = None
    ) -> PythonState:
        """``settings``: further dicts put back shallowly (the optimizers' parameter groups and the schedulers'
        attributes: a step that sets or scales the learning rate on its own schedule must not do it in a dry
        pass). ``objects``: further objects of the user's whose attributes are saved like a module's (the
        callbacks and the datamodule, whose hooks a dry pass re-runs)."""
        state = cls()
        for group in settings or []:
            state.undo.append(functools.partial(_refill_dict, group, dict(group)))
        skip = {id(t) for t in module.parameters()} | {id(t) for t in module.buffers()}
        modules = list(module.named_modules(remove_duplicate=True))
        seen = {id(m) for _, m in modules} | skip
        budget = [MAX_OBJECTS, TENSOR_COPY_BYTES]
        internal = _internal_names()
        for name, m in modules:
            keys = [k for k in m.__dict__ if k not in internal and not k.startswith("_dp_")]
            state._replay(m.__dict__, keys)
            attributes = {k: m.__dict__[k] for k in keys}
            state.undo.append(functools.partial(_restore_attributes, m, attributes, dict(m._modules)))
            for key, value in attributes.items():
                state._visit(value, f"{name or 'self'}.{key}", seen, budget)
        for obj in objects or []:
            state._visit(obj, type(obj).__name__, seen, budget)
        return state

    def _replay(self, items: dict[Any, Any] | list[Any], keys: list[Any] | None = None) -> None:
        """Put a :class:`ReplayingIterator` in place of each iterator held in ``items`` (a dict: at ``keys``)."""
        if keys is None or isinstance(items, list):
            _replay_iterators(items, self.proxies)
            return
        part = {k: items[k] for k in keys}
        _replay_iterators(part, self.proxies)
        items.update(part)

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
            if isinstance(x, ReplayingIterator):
                self.undo.append(functools.partial(x._rewind, x._position))
            elif isinstance(x, list):
                self._replay(x)
                self.undo.append(functools.partial(_refill_list, x, list(x)))
                children = x
            elif isinstance(x, dict):
                self._replay(x)
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
            elif _walked(x) or isinstance(x, nn.Module):  # a module outside the tree: a callback's EMA copy
                children = [*x.parameters(), *x.buffers()] if isinstance(x, nn.Module) else []
                if _walked(x):
                    self._replay(x.__dict__)
                    self.undo.append(functools.partial(_refill_dict, x.__dict__, dict(x.__dict__)))
                    children += list(x.__dict__.values())
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
        if t.is_sparse or t.layout != torch.strided or t.is_meta:
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
    """What a dry pass could change in the optimization the module's trainer runs: the optimizers' parameter
    groups (lr, momentum, ...) and each learning-rate scheduler's attributes (its step count, last lrs)."""
    trainer = getattr(module, "_trainer", None)
    try:
        optimizers = list(trainer.optimizers) if trainer is not None else []
        configs = list(trainer.lr_scheduler_configs) if trainer is not None else []
    except Exception:  # no strategy or optimizers yet
        return []
    groups = [g for o in optimizers for g in getattr(o, "param_groups", []) if isinstance(g, dict)]
    schedulers = [
        vars(c.scheduler) for c in configs if isinstance(getattr(c.scheduler, "__dict__", None), dict)
    ]
    return groups + schedulers


def _companions(module: nn.Module) -> list[Any]:
    """The objects of the user's besides the module whose state a dry pass may touch: the trainer's callbacks
    of the user's own classes (their hooks are re-run), and the datamodule when it overrides a batch hook."""
    trainer = getattr(module, "_trainer", None)
    if trainer is None:
        return []
    found = [c for c in getattr(trainer, "callbacks", None) or [] if _walked(c)]
    datamodule = getattr(trainer, "datamodule", None)
    if (
        isinstance(module, LightningModule)
        and _walked(datamodule)
        and any(_transfer_hook_owner(module, name) is datamodule for name in TRANSFER_HOOKS)
    ):
        found.append(datamodule)
    return found


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
    each parameter's ``.grad``, each buffer (the object and its values), and the Python state
    (:class:`PythonState`) of the module tree, of the user's callbacks and datamodule, of the optimizers'
    parameter groups and of the learning-rate schedulers. Parameters themselves are only watched: a pass that writes one in place is
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
        state.python = PythonState.save(module, _optimizer_settings(module), _companions(module))
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
