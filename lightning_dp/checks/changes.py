"""What the run can see change between steps: the mixing check then looks at the first batch after it.

Mixing that starts later in a run (mixup from epoch 1, a curriculum that switches on a batch statistic, a
callback that starts writing the model) is refused only on a checked batch, and within the overhead budget
random checks come about one batch in 60 after the first. So, besides those, the first batch of every epoch
is checked, and so is the first batch after any change the run can see:

* which parameters train (an unfreeze), and which modules are in training mode;
* the optimizers' settings: their parameter groups and hyperparameters (a scheduler's milestone);
* the train loader (a reload) and the trainer's callbacks (one added);
* the plain settings (numbers, strings, flags) of the LightningModule, of the user's callbacks and of the
  datamodule: a curriculum's stage, ``self.use_mixup = True``;
* the parameters and buffers written between steps (a callback that started writing the model).

A value that changes on every step (a counter, the last loss, a per-step learning rate) is a schedule, not a
change: each value makes the next batch checked only when it changes after holding still, and each time it
does, it must hold still twice as long before it does again (so one value adds at most log₂ T checks).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lightning.pytorch import LightningModule
from torch import nn

from lightning_dp.checks.snapshot import _internal_names, _walked

_PLAIN = (bool, int, float, str, type(None))


@dataclass
class _Watched:
    value: Any
    still: int = 0
    """Observations since it last changed."""
    rest: int = 1
    """How many it must hold still before a change counts (doubles each time one does)."""


@dataclass
class ChangeWatch:
    """The run's visible state at each sampled batch, and which of it changed since the last one."""

    watched: dict[str, _Watched] = field(default_factory=dict)
    epoch: int | None = None
    started: bool = False
    _modules: list[nn.Module] = field(default_factory=list)
    """The module tree, read once a fit (``named_modules`` costs more than the rest of a step's watch)."""

    def start_fit(self) -> None:
        """A new fit: the first batch (checked anyway) sets what later batches are compared with."""
        self.watched.clear()
        self.epoch = None
        self.started = False
        self._modules = []

    def observe(
        self, module: LightningModule, trainer: Any, engine: Any, written: Iterable[str]
    ) -> list[str]:
        """What changed since the last batch that the check should look at now (empty at the first batch)
        ``written``: the parameters and buffers written between the last two steps (not by the optimizer)."""
        epoch = getattr(trainer, "current_epoch", None) if trainer is not None else None
        found: list[str] = []
        if self.started and epoch != self.epoch:
            found.append(f"epoch {epoch} started")
        self.epoch = epoch
        if not self._modules or self._modules[0] is not module:
            self._modules = list(module.modules())
        now = dict(_state(module, self._modules, trainer, engine))
        now.update((f"written between steps: {n}", True) for n in written)
        for key in self.watched.keys() - now.keys():
            if not key.startswith("written between steps: "):  # a write seen once stays seen
                found += self._changed(key, None)
        for key, value in now.items():
            seen = self.watched.get(key)
            if seen is None:
                self.watched[key] = _Watched(value)
                if self.started:
                    found.append(key)
            elif not _same(seen.value, value):
                found += self._changed(key, value)
            else:
                seen.still += 1
        self.started = True
        return found

    def _changed(self, key: str, value: Any) -> list[str]:
        seen = self.watched[key]
        counts = seen.still >= seen.rest
        if counts:
            seen.rest *= 2
        seen.value, seen.still = value, 0
        if value is None:
            del self.watched[key]
        return [key] if counts else []


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b) and type(a) is type(b)


def _state(
    module: LightningModule, modules: list[nn.Module], trainer: Any, engine: Any
) -> Iterable[tuple[str, Any]]:
    """(name, plain value) of everything :class:`ChangeWatch` compares (see the module docstring)."""
    trained = [p.requires_grad for m in modules for p in m._parameters.values() if p is not None]
    yield "trained parameters", tuple(trained)
    yield "modules in training mode", tuple(m.training for m in modules)
    yield "train loader", id(getattr(engine, "train_data", None))
    callbacks = list(getattr(trainer, "callbacks", None) or []) if trainer is not None else []
    yield "callbacks", tuple(id(c) for c in callbacks)
    for i, optimizer in enumerate(getattr(trainer, "optimizers", None) or [] if trainer is not None else []):
        for j, group in enumerate(getattr(optimizer, "param_groups", [])):
            for key, value in group.items():
                if key != "params" and isinstance(value, (*_PLAIN, tuple)):
                    yield f"optimizer {i} group {j} {key}", value
            yield f"optimizer {i} group {j} size", len(group.get("params", ()))
    yield from _settings(type(module).__name__, module, _internal_names())
    for callback in callbacks:
        if _walked(callback):
            yield from _settings(type(callback).__name__, callback, frozenset())
    datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
    if _walked(datamodule):
        yield from _settings(type(datamodule).__name__, datamodule, frozenset())


def _settings(owner: str, obj: Any, internal: frozenset[str]) -> Iterable[tuple[str, Any]]:
    """The plain attributes (numbers, strings, flags) an object holds itself."""
    for key, value in vars(obj).items():
        if type(value) in _PLAIN and key not in internal and not key.startswith("_dp_"):
            yield f"{owner}.{key}", value
