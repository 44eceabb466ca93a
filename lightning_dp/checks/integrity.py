"""The batch ``training_step`` receives is the batch the sampler drew, collated, and nothing else.

Lightning hands a batch to several hooks before the step: ``on_before_batch_transfer``,
``transfer_batch_to_device``, ``on_after_batch_transfer`` (which may return a new batch) and every
callback's and the module's ``on_train_batch_start`` (which may edit it in place). A hook that
standardises the batch, applies mixup or keeps a running statistic of it mixes examples before the step,
where no per-example gradient can see it. So each sampled batch is recorded as the private loader yields
it, and compared with what reaches ``training_step``: the same tensor objects at the same in-place versions
(a CPU run with no hooks: no hashing), else equal fingerprints (``fingerprint``: a device transfer). Any
other difference refuses the step before its release, naming the hooks that ran in between.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_dp.checks.fingerprint import Seen, fingerprint, unwrap
from lightning_dp.core.errors import DPConfigurationError

TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


@dataclass
class _Sampled:
    batch: Any
    seen: Seen


@dataclass
class BatchIntegrity:
    """Sampled batches in delivery order, and the batch as the transfer to the device left it."""

    pending: deque[_Sampled] = field(default_factory=deque)
    transferred: Seen | None = None
    convert_input: Any = None
    """The precision plugin's ``convert_input`` (a dtype cast under ``*-true`` precision), applied to the
    sampled batch before comparing: Lightning applies it to every batch."""
    checked: int = 0

    def new_pass(self) -> None:
        """A new iterator over the train loader: batches drawn by an abandoned one are never delivered."""
        self.pending.clear()
        self.transferred = None

    def sampled(self, batch: Any) -> None:
        """The private loader yields ``batch`` (main process, after the collate function)."""
        self.pending.append(_Sampled(batch, Seen.of(batch)))

    def after_transfer(self, batch: Any) -> None:
        """The batch as ``batch_to_device`` returns it (after the transfer hooks)."""
        self.transferred = Seen.of(batch)

    def check(self, batch: Any, module: LightningModule, trainer: Trainer | None) -> None:
        """Refuse a batch that is not the next sampled batch, unchanged (called before user code runs)."""
        if not self.pending:
            return  # not from the private loader (no record): nothing to compare with
        sampled = self.pending.popleft()
        transferred, self.transferred = self.transferred, None
        self.checked += 1
        if sampled.seen.unchanged(batch):
            return
        intact = all(
            t._version == v for t, (_, v) in zip(sampled.seen._keep, sampled.seen.tensors, strict=True)
        )
        if intact:
            source = (
                sampled.batch if self.convert_input is None else self.convert_input(unwrap(sampled.batch))
            )
            before, after = fingerprint(source), fingerprint(batch)
            if before is None or after is None or before.same(after):
                return
        # The batch as the transfer left it, still unchanged now: the change came before or during the
        # transfer; changed since: in on_train_batch_start (callbacks' or the module's)
        during = transferred is None or transferred.unchanged(batch)
        raise DPConfigurationError(_message(module, trainer, during_transfer=during))


def _message(module: LightningModule, trainer: Trainer | None, during_transfer: bool) -> str:
    if during_transfer:
        hooks = [f"LightningModule.{h}" for h in TRANSFER_HOOKS if is_overridden(h, module)]
        where = " or ".join(hooks) or "the transfer to the device (" + ", ".join(TRANSFER_HOOKS) + ")"
    else:
        callbacks = [
            type(c).__name__
            for c in (trainer.callbacks if trainer is not None else [])  # type: ignore[attr-defined]
            if is_overridden("on_train_batch_start", c)
        ]
        parts = [f"the on_train_batch_start of {', '.join(callbacks)}"] if callbacks else []
        if is_overridden("on_train_batch_start", module):
            parts.append("LightningModule.on_train_batch_start")
        where = " or ".join(parts) or "a hook between the loader and training_step"
    return (
        f"The batch that reached training_step is not the batch the sampler drew: {where} changed it. "
        "Hooks that run on the whole batch before the step (standardising it with its own statistics, mixup "
        "or cutmix in a callback, a running statistic updated from it) mix examples where no per-example "
        "gradient sees it, so one example can move the released sum by more than max_grad_norm and ε does "
        "not hold. This step releases nothing. Transform each example on its own in the Dataset (or the "
        "collate_fn), or inside training_step, and keep batch hooks free of edits to the batch."
    )
