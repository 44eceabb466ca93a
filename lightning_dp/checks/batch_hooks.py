"""The user's per-batch hooks, which a dry pass re-runs on its own batch before ``training_step``.

Lightning runs the transfer hooks and every ``on_train_batch_start`` on a training batch before the step;
a statistic one of them computes from the batch must be one of the dry pass's batch, so a dry pass replays
them (:func:`run_batch_hooks`), and a hook that raises there is refused by name (:func:`hook_failure_message`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning.pytorch import Callback, LightningDataModule, LightningModule
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_dp.checks.integrity import TRANSFER_HOOKS
from lightning_dp.core.errors import DPConfigurationError, quote_error

_LIBRARY_PACKAGES = frozenset({"lightning", "pytorch_lightning", "lightning_fabric", "lightning_dp"})


@dataclass(frozen=True)
class BatchHook:
    """One hook of the user's that Lightning runs on a training batch before ``training_step``."""

    name: str
    """How a message names it: ``"Std.on_train_batch_start"`` (the class of the object it runs on, and the hook)."""
    call: Callable[[Any], Any]
    """Run it on a batch (its return value is not used: the batch-integrity check already refuses a hook
    that returns another batch or edits it)."""


def _users_hook(owner: Any, name: str, parent: type) -> bool:
    """Whether ``owner``'s ``name`` is the user's own: overridden, and not defined by Lightning or lightning-dp
    (their callbacks that log on each batch, a learning-rate or device-stats monitor, are not re-run)."""
    if not is_overridden(name, owner, parent):
        return False
    defined_in = getattr(getattr(type(owner), name, None), "__module__", None) or ""
    return defined_in.partition(".")[0] not in _LIBRARY_PACKAGES


def users_hooks(module: LightningModule, name: str, callbacks: bool = True) -> list[Any]:
    """Who holds a ``name`` hook you wrote, in Lightning's order: every callback (unless ``callbacks`` is
    False), then the module; Lightning's and lightning-dp's own are left out (:func:`_users_hook`)."""
    trainer = module._trainer
    found = list(getattr(trainer, "callbacks", None) or []) if trainer is not None and callbacks else []
    owners: list[Any] = [c for c in found if _users_hook(c, name, Callback)]
    return [*owners, module] if _users_hook(module, name, LightningModule) else owners


def _transfer_hook_owner(module: LightningModule, name: str) -> Any:
    """The object whose ``name`` Lightning calls: the datamodule's where it overrides it, else the module's."""
    trainer = module._trainer
    selector = getattr(getattr(trainer, "_data_connector", None), "_datahook_selector", None)
    if selector is None:
        return module
    try:
        return selector.get_instance(name)
    except Exception:  # no datamodule attached (a loader passed to fit): the module's hook
        return module


def batch_hooks(module: LightningModule, batch_idx: int = 0) -> list[BatchHook]:
    """The per-batch hooks you wrote that Lightning runs on a training batch before ``training_step``, in its
    order: ``on_before_batch_transfer``, ``transfer_batch_to_device``, ``on_after_batch_transfer`` (the
    module's, or the datamodule's), every callback's ``on_train_batch_start``, then the module's. Only
    overridden ones, and not Lightning's or lightning-dp's own callbacks."""
    hooks: list[BatchHook] = []
    for name in TRANSFER_HOOKS:
        owner = _transfer_hook_owner(module, name)
        parent = LightningModule if isinstance(owner, LightningModule) else LightningDataModule
        if not _users_hook(owner, name, parent):
            continue
        method = getattr(owner, name)
        call: Callable[[Any], Any]
        if name == "transfer_batch_to_device":
            call = functools.partial(_transfer, method, module)
        else:
            call = functools.partial(_call_with, method, 0)
        hooks.append(BatchHook(f"{type(owner).__name__}.{name}", call))
    trainer = module._trainer
    for owner in users_hooks(module, "on_train_batch_start"):
        call = (
            functools.partial(_call_with, module.on_train_batch_start, batch_idx)
            if owner is module
            else functools.partial(_callback_batch_start, owner, trainer, module, batch_idx)
        )
        hooks.append(BatchHook(f"{type(owner).__name__}.on_train_batch_start", call))
    return hooks


def _call_with(method: Callable[..., Any], index: int, batch: Any) -> Any:
    return method(batch, index)


def _transfer(method: Callable[..., Any], module: LightningModule, batch: Any) -> Any:
    return method(batch, module.device, 0)


def _callback_batch_start(
    callback: Any, trainer: Any, module: LightningModule, index: int, batch: Any
) -> Any:
    return callback.on_train_batch_start(trainer, module, batch, index)


def run_batch_hooks(module: LightningModule, batch: Any, batch_idx: int) -> None:
    """Run :func:`batch_hooks` on ``batch`` (in a dry pass): a hook that raises is refused by name."""
    for hook in batch_hooks(module, batch_idx):
        try:
            hook.call(batch)
        except DPConfigurationError:
            raise
        except Exception as error:  # the user's hook on a batch the check made: refused, never raised as is
            raise DPConfigurationError(hook_failure_message(hook.name, error)) from error


def hook_note(module: LightningModule, batch_idx: int = 0) -> str:
    """For a mixing refusal: the user's per-batch hooks both passes re-ran, by name ("" when none), since a
    statistic of the batch computed in one of them and read by the step mixes examples too."""
    names = [hook.name for hook in batch_hooks(module, batch_idx)]
    if not names:
        return ""
    return (
        f" Your per-batch hooks {', '.join(names)} ran before training_step in both passes, each on its own "
        "batch: a statistic of the batch computed there (a mean or std to standardise with, a min or max to "
        "scale by, class counts) and read by the step mixes examples as if computed in the step; compute it "
        "from each example alone, or from public data, inside training_step."
    )


def hook_failure_message(name: str, error: BaseException) -> str:
    """The refusal for a per-batch hook that raised when a dry pass re-ran it (one line: it is quoted)."""
    return (
        f"Your {name} raised {quote_error(error)} when lightning-dp's run-time check re-ran it on a training "
        "batch (the sampled batch, or that batch with some examples removed or replaced). The check re-runs "
        "the per-batch hooks you override on its own batch (before your training_step, the hooks inside the "
        "optimizer step around its backward, and on_train_batch_end after it), so that what a hook computes from the batch is seen for what it is, examples "
        "mixed across the batch or written into the model. "
        "Nothing was released. Let the hook run more than once per step, on any batch of distinct or repeated "
        "examples: compute per-example transforms in the Dataset or in training_step, no statistic of the "
        "whole batch, and keep work that must happen once per real batch (writing a file, asserting on a "
        "counter) behind `if not lightning_dp.checking()`."
    )
