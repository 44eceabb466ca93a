"""The user's hooks after the optimizer step, run in each of the mixing check's dry passes.

``on_train_batch_end`` (of the user's callbacks, then of the LightningModule) receives the batch and
``outputs`` (the step's loss, and whatever else ``training_step`` returned: activations, codes). A parameter or
buffer it writes from them holds private data with no noise: a dormant-unit reset (ReDo) that re-initialises
the units the batch left inactive, a VQ-VAE codebook restart that copies the batch's encodings into the
codebook. A write that reads no private data (an EMA of the weights, clamping, a schedule on the step count)
is post-processing of released weights and stays allowed. So each dry pass runs these hooks after its
backward, on its own batch and its own ``outputs``, from the state an after-step hook sees, the same in both
passes: the trainer's step count advanced by one, the weights and learning rates of a step that moved nothing,
every ``.grad`` as the previous release left it (zeros before the first), the loggers, optimizers, schedulers
and ``trainer.save_checkpoint`` dry. What the hooks wrote is compared between the passes, value by value: a
write that differs read the batch, and is refused before the release, naming the hooks and the tensors.

A hook may write only on some steps (``if trainer.global_step % k == 0``, every ``k``-th ``batch_idx``), so
the counters of the checked step alone may be ones on which it writes nothing. From the second step on, each
pass therefore runs the hooks twice: first as the previous step's hooks saw the trainer (its
``global_step`` and ``batch_idx``), then as this step's will. The first write of a parameter between two
steps makes the next batch a checked one (``changes.py``), so a hook that wrote from the batch on the step
before is run again on that step's counters, on this batch, and refused before the next release.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor

from lightning_dp.checks.batch_hooks import hook_failure_message, users_hooks
from lightning_dp.checks.dry_flag import _dry
from lightning_dp.checks.snapshot import ModuleState
from lightning_dp.checks.state import ParameterValues
from lightning_dp.checks.user_step import (
    DryPass,
    _detached_loggers,
    _detached_logging,
    _no_op,
    _shadowed,
    dry_shadows,
)
from lightning_dp.core.errors import DPConfigurationError


@dataclass(frozen=True)
class AfterStepHook:
    """One hook of the user's that Lightning runs after the optimizer step, with the batch."""

    name: str
    """How a message names it: ``"ReDo.on_train_batch_end"``."""
    call: Callable[[Any, Any], Any]
    """Run it on (``outputs``, batch)."""


def after_step_hooks(module: LightningModule, batch_idx: int = 0) -> list[AfterStepHook]:
    """The ``on_train_batch_end`` hooks you wrote, in Lightning's order: every callback's, then the module's
    (Lightning's and lightning-dp's own callbacks, which log and save checkpoints, are not run)."""
    trainer = module._trainer
    hooks: list[AfterStepHook] = []
    for owner in users_hooks(module, "on_train_batch_end"):
        call = (
            functools.partial(_module_batch_end, module, batch_idx)
            if owner is module
            else functools.partial(_callback_batch_end, owner, trainer, module, batch_idx)
        )
        hooks.append(AfterStepHook(f"{type(owner).__name__}.on_train_batch_end", call))
    return hooks


def _callback_batch_end(
    callback: Any, trainer: Any, module: LightningModule, index: int, outputs: Any, batch: Any
) -> Any:
    return callback.on_train_batch_end(trainer, module, outputs, batch, index)


def _module_batch_end(module: LightningModule, index: int, outputs: Any, batch: Any) -> Any:
    return module.on_train_batch_end(outputs, batch, index)


def lightning_outputs(module: LightningModule, output: Any) -> Any:
    """The ``outputs`` Lightning hands ``on_train_batch_end`` for what ``training_step`` returned: under
    automatic optimization ``{"loss": loss.detach(), **the other keys}``, under manual a dict with the loss
    detached (Lightning's ``ClosureResult`` and ``ManualResult``)."""
    if isinstance(output, Tensor):
        return {"loss": output.detach().clone()}
    if isinstance(output, Mapping):
        out = dict(output)
        if isinstance(out.get("loss"), Tensor):
            out["loss"] = out["loss"].detach().clone()
        return out
    return {} if not module.automatic_optimization else None


def after_step_writes(
    module: LightningModule,
    batch: Any,
    batch_idx: int,
    dry: DryPass,
    state: ModuleState,
    values: ParameterValues,
) -> dict[str, Tensor]:
    """Run :func:`after_step_hooks` in a dry pass, after its backward (:func:`run_after_step`); every
    parameter and buffer whose value then differs from the pass's start, by name, with its value (empty when
    you wrote no such hook). From the second step on, the hooks run first on the previous step's counters:
    what they write there beyond what the step itself wrote (a buffer of the forward's stays the forward's,
    compared and refused as such) is kept under :data:`PREVIOUS_STEP` names, so a later write on this
    step's counters cannot hide it."""
    if not users_hooks(module, "on_train_batch_end"):
        return {}
    outputs = lightning_outputs(module, dry.output)
    out: dict[str, Tensor] = {}
    tracker = _step_tracker(module._trainer)
    if tracker is not None and tracker.completed >= 1:  # the previous step's counters, then this step's
        by_the_step = set(_written(module, state, values))  # the forward's buffers: compared as the forward's
        previous = after_step_hooks(module, batch_idx - 1 if batch_idx >= 1 else batch_idx)
        run_after_step(module, previous, outputs, batch, state, steps_taken=0)
        written = _written(module, state, values)
        out = {PREVIOUS_STEP + name: value for name, value in written.items() if name not in by_the_step}
    run_after_step(module, after_step_hooks(module, batch_idx), outputs, batch, state)
    return {**out, **_written(module, state, values)}


PREVIOUS_STEP = "\x00previous step: "
"""Marks, in :func:`after_step_writes`, what the hooks wrote on the previous step's counters."""


def _written(module: LightningModule, state: ModuleState, values: ParameterValues) -> dict[str, Tensor]:
    """Every parameter and buffer whose value differs from the pass's start, by name, with its value."""
    params = dict(module.named_parameters())
    written = {n: params[n].detach().clone() for n in values.written() if n in params}
    return {**state.written_buffers(), **written}


def run_after_step(
    module: LightningModule,
    hooks: list[AfterStepHook],
    outputs: Any,
    batch: Any,
    state: ModuleState,
    steps_taken: int = 1,
) -> None:
    """Run ``hooks`` as Lightning does after the step, with nothing logged, stepped or saved; a hook that
    raises is refused by name (:func:`hook_failure_message`). ``steps_taken``: how far the trainer's step
    count is moved, 1 as after this step, 0 as the previous step's hooks saw it."""
    with torch.no_grad():
        for p, saved in state.grads:
            if saved is not None:
                p.grad = saved.detach().clone()
            elif p.requires_grad:
                p.grad = torch.zeros_like(p)
    trainer = module._trainer
    with (
        _dry(),
        _shadowed(module, **dry_shadows(module)),
        _detached_loggers(module),
        _detached_logging(module),
        _trainer_as_after_step(trainer, steps_taken),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        for hook in hooks:
            try:
                hook.call(outputs, batch)
            except DPConfigurationError:
                raise
            except Exception as error:  # the user's hook on a batch the check made: refused, never raised
                raise DPConfigurationError(hook_failure_message(hook.name, error)) from error


@contextlib.contextmanager
def _trainer_as_after_step(trainer: Any, steps_taken: int = 1) -> Iterator[None]:
    """The trainer as an after-step hook sees it: ``global_step`` ``steps_taken`` higher (the step just taken),
    and ``save_checkpoint`` and ``should_stop`` that the hooks cannot act on."""
    if trainer is None:
        yield
        return
    should_stop = trainer.should_stop
    trainer.__dict__["save_checkpoint"] = _no_op
    try:
        with steps_shifted(_step_tracker(trainer), steps_taken):
            yield
    finally:
        trainer.__dict__.pop("save_checkpoint", None)
        trainer.should_stop = should_stop


@contextlib.contextmanager
def steps_shifted(tracker: Any, shift: int) -> Iterator[None]:
    """``trainer.global_step`` moved by ``shift`` inside the block (the tracker :func:`_step_tracker` finds;
    None: nothing to move)."""
    if tracker is None or shift == 0:
        yield
        return
    tracker.completed += shift
    try:
        yield
    finally:
        tracker.completed -= shift


def _step_tracker(trainer: Any) -> Any:
    """The progress tracker ``trainer.global_step`` reads (automatic or manual optimization), or None."""
    try:
        loop = trainer.fit_loop.epoch_loop
        module = trainer.lightning_module
        if module is None or module.automatic_optimization:
            return loop.automatic_optimization.optim_progress.optimizer.step.total
        return loop.manual_optimization.optim_step_progress.total
    except AttributeError:  # not a fitting trainer
        return None


def after_step_write_message(names: list[str], hooks: list[str]) -> str:
    """The refusal for tensors an after-step hook wrote from the batch (one line: it is quoted)."""
    names = sorted({name.removeprefix(PREVIOUS_STEP) for name in names})
    return (
        f"The tensors {names} were written after the optimizer step by {', '.join(hooks)} from the private "
        "batch: the sensitivity check ran these hooks in both of its passes (the batch, and the batch with some "
        "examples removed or replaced), from the same state, and they wrote different values. A parameter or "
        "buffer written from the batch or from `outputs` (a dormant-unit reset that re-initialises the units "
        "the batch left inactive, a codebook restart that copies the batch's encodings, a statistic of the "
        "batch) puts private data into the model with no noise, so ε does not cover the model. Decide such "
        "writes from the weights alone or from public data (re-initialise units by their weights' norm, "
        "restart codes from public samples or with random vectors), or compute them in training_step from "
        "each example alone; writes that read no private data (an EMA of the weights, clamping, a schedule "
        "on trainer.global_step) are allowed."
    )
