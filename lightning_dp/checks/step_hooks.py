"""The user's hooks inside the optimizer step, run in each of the mixing check's dry passes (issue #47).

Between ``training_step`` and the optimizer step Lightning runs ``on_before_zero_grad`` (after the forward,
with the last release's ``.grad``), ``on_before_backward`` (with the loss), the module's own ``backward``
(which the dry pass then calls for ``loss.backward()``), ``on_after_backward`` (with the NON-private
gradient: autograd's gradient of the batch, before clipping and noise) and ``on_before_optimizer_step``
(with the released gradient), each a Callback's first, then the module's. What
such a hook writes from what it sees (the gradient in ``on_after_backward``, the loss, a batch
``training_step`` kept on ``self``) is private data with no noise wherever it goes: a buffer, a frozen copy of
the weights, a tensor or a number on the module or on a callback (a scale the next forward reads, a learning
rate), a module a callback holds. So each dry pass runs these hooks where Lightning does, each seeing what it
sees in the real step: ``on_after_backward`` the pass's own gradient; ``on_before_zero_grad`` and
``on_before_optimizer_step`` the gradients the last release left (zeros before the first: the release is
noisy and what is computed from it post-processing, so both passes see the same). What the hooks wrote, from
the state right after ``training_step``, is compared between the passes value by value: a write that differs
read the batch, and is refused before the release, naming the hooks and what they wrote. Hooks that read and
log (the released gradient's norms in ``on_before_optimizer_step``, a counter) write nothing that differs.

A hook may write only on some steps (``if trainer.global_step % k == 0``): from the second step on, each
stage's hooks run twice in a pass, first with ``global_step`` as the previous step saw it, then as this step
sees it. A buffer the step wrote on an unchecked step makes the next batch a checked one
(``checks/state.py``), whose passes then run the hooks on the counters of the step that wrote it.
"""

from __future__ import annotations

import contextlib
import functools
import math
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from lightning_dp.checks.after_step import _step_tracker, steps_shifted
from lightning_dp.checks.batch_hooks import hook_failure_message, users_hooks
from lightning_dp.checks.dry_flag import _dry
from lightning_dp.checks.snapshot import (
    TENSOR_COPY_BYTES,
    ModuleState,
    _companions,
    _internal_names,
    _walked,
    same_values,
)
from lightning_dp.checks.state import ParameterValues
from lightning_dp.checks.user_step import (
    _detached_loggers,
    _detached_logging,
    _DryOptimizer,
    _shadowed,
    dry_shadows,
)
from lightning_dp.core.errors import DPConfigurationError

STAGES = (
    "on_before_zero_grad",
    "on_before_backward",
    "backward",
    "on_after_backward",
    "on_before_optimizer_step",
)
"""The hooks Lightning runs between ``training_step`` and the optimizer step, in its order (``backward``: the
module's own, which the dry pass calls in place of ``loss.backward()``)."""

_RELEASED = frozenset({"on_before_zero_grad", "on_before_optimizer_step"})
"""The stages that see a released gradient (the last one, or this step's), not this batch's own."""


@dataclass(frozen=True)
class StepHook:
    """One hook of the user's that Lightning runs inside the optimizer step."""

    name: str
    """How a message names it: ``"GradStash.on_after_backward"``."""
    stage: str
    call: Callable[..., Any]
    """Run it with the stage's own arguments (none, the loss, or an optimizer)."""


def step_hooks(module: LightningModule) -> list[StepHook]:
    """The step hooks you wrote, stage by stage in Lightning's order, each stage every callback's and then
    the module's (Lightning's and lightning-dp's own callbacks are not run)."""
    trainer = module._trainer
    hooks: list[StepHook] = []
    for stage in STAGES:  # the module's backward has no callback twin
        for owner in users_hooks(module, stage, callbacks=stage != "backward"):
            call = getattr(owner, stage)
            call = call if owner is module else functools.partial(call, trainer, module)
            hooks.append(StepHook(f"{type(owner).__name__}.{stage}", stage, call))
    return hooks


@dataclass
class StepHookRun:
    """The step hooks of one dry pass: :func:`~lightning_dp.checks.user_step.dry_training_step` calls
    :meth:`before_backward` and :meth:`after_backward` around each backward, the mixing check's pass
    :meth:`before_optimizer_step` once its gradients are collected; :attr:`writes` is then what they wrote."""

    module: LightningModule
    hooks: list[StepHook]
    state: ModuleState
    values: ParameterValues
    forward: tuple[list[str], dict[str, Tensor], dict[str, Tensor]] | None = None
    """What ``training_step`` wrote (trained parameters, frozen ones, buffers), taken before any hook ran."""
    writes: dict[str, Any] = field(default_factory=dict)
    """Everything the hooks changed, by name, with its new value."""
    _start: _Watch | None = None

    @classmethod
    def of(cls, module: LightningModule, state: ModuleState, values: ParameterValues) -> StepHookRun | None:
        """The pass's run, None when you wrote no step hook."""
        hooks = step_hooks(module)
        return cls(module, hooks, state, values) if hooks else None

    def before_backward(self, loss: Tensor) -> None:
        """Before a backward: the first time, what the forward wrote and ``on_before_zero_grad`` (automatic
        optimization); each time, ``on_before_backward``."""
        if self.forward is None:
            self._begin()
            if self.module.automatic_optimization:
                self._run("on_before_zero_grad")
        self._run("on_before_backward", loss)

    def after_backward(self) -> None:
        self._run("on_after_backward")

    def before_optimizer_step(self) -> None:
        """``on_before_optimizer_step``, then :attr:`writes`: what every hook of the pass changed."""
        if self.forward is None:
            self._begin()
        self._run("on_before_optimizer_step")
        assert self._start is not None
        self.writes = self._start.changed(_Watch.take(self.module, self.state, self.values))

    def _begin(self) -> None:
        trained, frozen = self.values.written_by_kind()
        self.forward = (trained, frozen, self.state.written_buffers())
        self._start = _Watch.take(self.module, self.state, self.values)

    def _run(self, stage: str, *args: Any) -> None:
        """Every hook of ``stage`` (once per optimizer where it takes one), with nothing logged or stepped;
        one that raises is refused by name."""
        hooks = [hook for hook in self.hooks if hook.stage == stage]
        if not hooks:
            return
        module = self.module
        calls = [(o,) for o in _dry_optimizers(module)] if stage in _RELEASED else [args]
        gradients = _released_gradients(self.state) if stage in _RELEASED else contextlib.nullcontext()
        tracker = _step_tracker(module._trainer)
        shifts = (-1, 0) if tracker is not None and tracker.completed >= 1 else (0,)
        with (
            gradients,
            _dry(),
            _shadowed(module, **dry_shadows(module)),
            _detached_loggers(module),
            _detached_logging(module),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")
            for shift in shifts:  # the previous step's global_step, then this step's (module docstring)
                with steps_shifted(tracker, shift):
                    for hook in hooks:
                        for arguments in calls:
                            try:
                                hook.call(*arguments)
                            except DPConfigurationError:
                                raise
                            except Exception as error:  # the user's hook on a batch the check made: refused
                                raise DPConfigurationError(hook_failure_message(hook.name, error)) from error


def _dry_optimizers(module: LightningModule) -> list[Any]:
    """The trainer's optimizers as a hook gets them, whose ``step`` and ``zero_grad`` do nothing."""
    trainer = module._trainer
    try:
        optimizers = list(trainer.optimizers) if trainer is not None else []
    except Exception:  # no strategy attached
        optimizers = []
    return [_DryOptimizer(o) for o in optimizers] or [None]


@contextlib.contextmanager
def _released_gradients(state: ModuleState) -> Iterator[None]:
    """Every ``.grad`` as the last release left it (zeros before the first), put back after the block: what a
    hook computes from a released gradient is post-processing, so both passes see the same one."""
    current = [(p, p.grad) for p, _ in state.grads]
    with torch.no_grad():
        for p, saved in state.grads:
            if saved is not None:
                p.grad = saved.detach().clone()
            else:
                p.grad = torch.zeros_like(p) if p.requires_grad else None
    try:
        yield
    finally:
        for p, grad in current:
            p.grad = grad


@dataclass
class _Watch:
    """What a step hook may write, read at one moment: the module's parameters and buffers (written since the
    pass began, by value), and, by where they are held, the tensors and numbers of the module's and the user's
    callbacks' attributes (and of the lists, dicts and modules those hold), and the optimizers' settings."""

    parameters: dict[str, Tensor]
    held: dict[str, tuple[Any, Any]]
    """Where → (the object, what identifies its state: for a tensor its storage, version and checksum)."""

    @classmethod
    def take(cls, module: LightningModule, state: ModuleState, values: ParameterValues) -> _Watch:
        trained, frozen = values.written_by_kind()
        params = dict(module.named_parameters())
        written = {n: params[n].detach().clone() for n in trained if n in params}
        held = {where: (x, _identity(x)) for where, x in _held(module)}
        return cls({**written, **frozen, **state.written_buffers()}, held)

    def changed(self, now: _Watch) -> dict[str, Any]:
        """What differs in ``now`` from this moment, with its value in ``now`` (of a list that only grew, the
        items added)."""
        before = self.parameters
        out: dict[str, Any] = {
            n: v for n, v in now.parameters.items() if n not in before or not same_values(before[n], v)
        }
        for where, (x, identity) in now.held.items():
            then = self.held.get(where)
            if then is None or then[0] is not x:
                out[where] = _value(x)
            elif not _same(then[1], identity):
                count, items = then[1] if isinstance(x, list) else (-1, ())
                grew = isinstance(x, list) and identity[1][:count] == items
                out[where] = ("added", _value(x[count:])) if grew else _value(x)
        return out


def _held(module: LightningModule) -> Iterator[tuple[str, Any]]:
    """(where, object) of everything :class:`_Watch` reads beside the module's parameters and buffers."""
    internal = _internal_names()
    own = {id(x) for x in (*module.modules(), *module.parameters(), *module.buffers())}
    owners: list[tuple[str, Any]] = [(_where(module, n), m) for n, m in module.named_modules()]
    owners += [(type(c).__name__, c) for c in _companions(module)]
    for owner_name, owner in owners:
        for key, value in vars(owner).items():
            if key in internal or key.startswith("_dp_") or id(value) in own:
                continue
            where = f"{owner_name}.{key}"
            if isinstance(value, nn.Module):  # a module a callback holds (an EMA copy, a teacher)
                yield from ((f"{where}.{n}", t) for n, t in _module_tensors(value))
            elif _watched(value):
                yield where, value
            elif (attributes := _attributes(value)) is not None:  # an object holding statistics
                yield where, attributes
    trainer = module._trainer
    optimizers = (getattr(trainer, "optimizers", None) or []) if trainer is not None else []
    for i, optimizer in enumerate(optimizers):
        for j, group in enumerate(getattr(optimizer, "param_groups", [])):
            for key, value in group.items():
                if key != "params" and _watched(value):
                    yield f"optimizer {i} group {j} {key}", value


def _where(module: nn.Module, name: str) -> str:
    return f"{type(module).__name__}.{name}" if name else type(module).__name__


def _module_tensors(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    yield from module.named_parameters()
    yield from module.named_buffers()


def _watched(value: Any) -> bool:
    return isinstance(value, Tensor | bool | int | float | list | tuple | dict)


def _attributes(value: Any) -> dict[str, Any] | None:
    """The attributes of an object of the user's (or a namespace) held there, read like a dict."""
    return vars(value) if _walked(value) or isinstance(value, types.SimpleNamespace) else None


def _identity(x: Any) -> Any:
    """What changes when ``x`` is written: a tensor's storage, version and checksum; a container's items (by
    object); a number itself."""
    if isinstance(x, Tensor):
        to_local = getattr(x, "to_local", None)  # an FSDP2 shard's own rows (no collective)
        data = (to_local() if callable(to_local) else x).detach()
        small = data.numel() * data.element_size() <= TENSOR_COPY_BYTES and not data.is_complex()
        checksum = float(data.double().square().sum()) if small and data.numel() else 0.0
        return (data.data_ptr(), x._version, checksum)
    if isinstance(x, list | tuple):
        return (len(x), tuple(id(i) for i in x))
    if isinstance(x, dict):
        return tuple((k, id(v)) for k, v in x.items())
    return x


def _value(x: Any) -> Any:
    """A copy of what ``x`` holds, to compare with the other pass's: tensors cloned, containers one level."""
    if isinstance(x, Tensor):
        return x.detach().clone()
    if isinstance(x, list | tuple):
        return tuple(_value(i) if isinstance(i, Tensor | bool | int | float) else type(i).__name__ for i in x)
    if isinstance(x, dict):
        return {
            k: _value(v) if isinstance(v, Tensor | bool | int | float) else type(v).__name__
            for k, v in x.items()
        }
    return x


def _same(a: Any, b: Any) -> bool:
    """Equal values (tensors by shape, dtype and values; NaN equal to NaN)."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and same_values(a, b)
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


def differing(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """What one pass's hooks wrote and the other's did not, or wrote differently (the step hooks' values, and
    the tensors the after-step hooks wrote)."""
    return sorted(n for n in a.keys() | b.keys() if n not in a or n not in b or not _same(a[n], b[n]))


def step_hook_write_message(names: list[str], hooks: list[str]) -> str:
    """The refusal for what a step hook wrote from the batch (one line: it is quoted)."""
    return (
        f"{names} were written inside the optimizer step by {', '.join(hooks)} from the private batch: the "
        "sensitivity check ran these hooks in both of its passes (the batch, and the batch with some examples "
        "removed or replaced), where Lightning runs them, and they wrote different values. on_after_backward "
        "sees the non-private gradient (autograd's, before clipping and noise), and any step hook may read what "
        "training_step kept (the batch, the loss): what it writes into a buffer, a frozen copy of the weights, "
        "a tensor or a number on the module or on a callback (a scale, a learning rate) or a module a callback "
        "holds is private data with no noise, so ε does not cover the model. Compute such values from the "
        "released gradient in on_before_optimizer_step (it sees the clipped, noised gradient), from the "
        "weights, or from public data; logging there or reading is fine. A value that differs for another "
        "reason (a timer, a memory reading) can be kept out of the check's passes with "
        "`if not lightning_dp.checking()`."
    )
