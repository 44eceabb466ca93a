"""Running the user's ``training_step`` as a dry pass: nothing logged, stepped, released or left behind.

The checks (and DPIS's norm pass) run the user's own step on a batch to read per-example gradients.
A dry pass first re-runs, on its own batch, the per-batch hooks the user wrote (:func:`batch_hooks`: the
transfer hooks, every callback's and the module's ``on_train_batch_start``), so a statistic a hook computes
from the batch is one of that pass's batch, as it is one of the real batch in the real step (the mixing check
also runs the hooks around its backward, ``step_hooks.py``). It detaches
``self.log``, and gives ``training_step`` optimizers and schedulers whose ``step`` does nothing (and, under
manual optimization, a ``manual_backward`` that only backpropagates), so the loop's counters, the optimizer
state, the learning rates and the ledger never see it. ``snapshot.py``'s :class:`ModuleState` puts back what the pass
touched: ``.grad``, buffers (values, and objects the forward replaced), the global random streams, and the
Python state of the module, its submodules, the user's callbacks and datamodule (:class:`PythonState`:
counters, lists, dicts, sets, the user's own generators; iterators and Python generators are replayed, not
copied: :class:`ReplayingIterator`), so the same program trains the same with the checks on or off.
The hooks it re-runs are ``batch_hooks.py``; whether a dry pass is running, ``dry_flag.py``.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from lightning.pytorch import LightningModule
from torch import Tensor, nn

from lightning_dp.checks.batch_hooks import _users_hook, run_batch_hooks
from lightning_dp.checks.dry_flag import _dry
from lightning_dp.checks.snapshot import PythonState, _companions, _optimizer_settings
from lightning_dp.per_example.capture import tracing


def training_step_loss(
    module: LightningModule, batch: Any, batch_idx: int = 0, keep_python_state: bool = True
) -> Tensor | None:
    """The loss ``module.training_step(batch, batch_idx)`` returns, with logging detached (None when it
    returns no loss: None, or a dict without ``"loss"``, which the real step reports in Lightning's words).

    ``keep_python_state``: put the module tree's Python state back after the call (:class:`PythonState`:
    DPIS's norm pass); off where the caller's :class:`ModuleState` does it (and reads the draws first)."""
    return _loss_of(training_step_output(module, batch, batch_idx, keep_python_state))


def training_step_output(
    module: LightningModule,
    batch: Any,
    batch_idx: int = 0,
    keep_python_state: bool = True,
    trace: Trace | None = None,
) -> Any:
    """What ``module.training_step(batch, batch_idx)`` returns, with logging detached (see
    :func:`training_step_loss`); ``trace`` records its torch calls (inside the capture's tracer)."""
    saved = (
        PythonState.save(module, _optimizer_settings(module), _companions(module))
        if keep_python_state
        else None
    )
    try:
        with _detached_logging(module), warnings.catch_warnings(), _dry(), tracing(module), _maybe(trace):
            warnings.simplefilter("ignore")
            return module.training_step(batch, batch_idx)
    finally:
        if saved is not None:
            saved.restore()


class Trace(Protocol):
    """A record of the torch calls user code makes (``checks/precision_path.py``'s ``OpTrace``)."""

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: Any) -> Any: ...

    def paused(self) -> contextlib.AbstractContextManager[None]: ...


def _maybe(context: contextlib.AbstractContextManager[Any] | None) -> contextlib.AbstractContextManager[Any]:
    return context if context is not None else contextlib.nullcontext()


def _loss_of(out: Any) -> Tensor | None:
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


class _DryLogger:
    """What the trainer's loggers are in a dry pass: what a hook or the step writes through them (metrics,
    hyperparameters, a graph, a save) goes nowhere; every other attribute is the logger's own (its
    ``experiment`` too: what is written there directly is written)."""

    def __init__(self, logger: Any) -> None:
        self._logger = logger

    log_metrics = log_hyperparams = log_graph = save = finalize = after_save_checkpoint = staticmethod(_no_op)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._logger, name)


@contextlib.contextmanager
def _detached_loggers(module: LightningModule) -> Iterator[None]:
    trainer = module._trainer
    saved = getattr(trainer, "loggers", None) if trainer is not None else None
    if not saved:
        yield
        return
    trainer.loggers = [_DryLogger(logger) for logger in saved]  # type: ignore[union-attr]
    try:
        yield
    finally:
        trainer.loggers = saved  # type: ignore[union-attr]


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
    """What ``self.lr_schedulers()`` returns in a dry pass: ``step`` does nothing (reads go to the scheduler)."""

    def __init__(self, scheduler: Any) -> None:
        self._scheduler = scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)


def _dry_handles(read: Callable[..., Any], wrap: Callable[[Any], Any]) -> Callable[..., Any]:
    """A stand-in for ``self.optimizers`` or ``self.lr_schedulers``: what ``read`` returns (one object, a list
    or None), each wrapped once per pass (the same wrapper on every call)."""
    wrapped: dict[int, Any] = {}

    def one(x: Any) -> Any:
        if id(x) not in wrapped:
            wrapped[id(x)] = wrap(x)
        return wrapped[id(x)]

    def handles(*args: Any, **kwargs: Any) -> Any:
        found = read(*args, **kwargs)
        if found is None:
            return None
        return [one(x) for x in found] if isinstance(found, list) else one(found)

    return handles


@dataclass
class DryPass:
    """One dry run of ``training_step``: its loss (automatic optimization) and how many backward passes
    it made itself (manual optimization)."""

    loss: Tensor | None = None
    backward_calls: int = 0
    output: Any = None
    """What ``training_step`` returned (the after-step hooks get it as ``outputs``)."""

    @property
    def backpropagated(self) -> bool:
        return self.backward_calls > 0


def dry_shadows(module: LightningModule) -> dict[str, Any]:
    """What ``self.optimizers`` and ``self.lr_schedulers`` are in a dry pass (for :func:`_shadowed`)."""
    kind = type(module)
    return {
        "optimizers": _dry_handles(functools.partial(kind.optimizers, module), _DryOptimizer),
        "lr_schedulers": _dry_handles(functools.partial(kind.lr_schedulers, module), _DryScheduler),
    }


class BackwardHooks(Protocol):
    """The user's hooks around a backward (``checks/step_hooks.py``), run where Lightning runs them."""

    def before_backward(self, loss: Tensor) -> None: ...

    def after_backward(self) -> None: ...


def dry_training_step(
    module: LightningModule,
    batch: Any,
    batch_idx: int,
    precision: Any,
    forward_only: bool = False,
    hooks: BackwardHooks | None = None,
    trace: Trace | None = None,
) -> DryPass:
    """Run the user's per-batch hooks (:func:`batch_hooks`) and ``training_step`` once on ``batch`` without
    side effects on training; backpropagate its loss (automatic optimization: here, outside the precision
    context as Lightning does; manual: ``manual_backward``), unless ``forward_only``, with ``hooks`` before
    and after each backward. ``trace`` records the torch calls of the batch hooks and the step (not of the
    backward and its hooks). A hook that raises is refused by name (:func:`hook_failure_message`)."""
    result = DryPass()

    def backward(loss: Tensor, *args: Any, **kwargs: Any) -> None:
        with trace.paused() if trace is not None else contextlib.nullcontext():
            if hooks is not None:
                hooks.before_backward(loss)
            if hooks is not None and _users_hook(module, "backward", LightningModule):
                module.backward(loss, *args, **kwargs)  # your own backward, as Lightning calls it
            else:
                loss.backward(*args, **kwargs)
            if hooks is not None:
                hooks.after_backward()

    def manual_backward(loss: Tensor, *args: Any, **kwargs: Any) -> None:
        result.backward_calls += 1
        if not forward_only:
            backward(loss, *args, **kwargs)

    shadows = dry_shadows(module)
    if not module.automatic_optimization:
        shadows["manual_backward"] = manual_backward
    with _dry(), _shadowed(module, **shadows), _detached_loggers(module):
        with _detached_logging(module), warnings.catch_warnings(), _maybe(trace):
            warnings.simplefilter("ignore")
            run_batch_hooks(module, batch, batch_idx)
        with precision.train_step_context():
            result.output = training_step_output(module, batch, batch_idx, False, trace)
            result.loss = _loss_of(result.output)
        if not module.automatic_optimization or forward_only:
            return result
        if result.loss is not None and result.loss.requires_grad:
            backward(result.loss)
            result.backward_calls = 1
    return result
