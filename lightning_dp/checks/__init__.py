"""Every run-time obligation of the privacy proof, listed by the moment it is verified.

The proof assumes things about the user's code that no setting shows. Each is checked here, at one of
four named moments, and a failure refuses the run before the release it would break (the strategy's
hooks only call these methods; ``docs/guarantees.md`` has the table):

* **set-up** (:meth:`RunChecks.setup`): layers that write their own weights in forward are refused.
* **each sampled batch, before user code** (:meth:`RunChecks.before_user_code`): on the first batch of a
  fit, which layer calls are shared by the batch (``structure``); the batch is the sampled batch,
  unchanged by hooks (``integrity``); no buffer was written between steps (``state``); and, on the first
  batch of a fit, of every epoch, after a change the run can see (``changes``) and on randomly drawn later
  ones, the mixing check (``mixing``) runs the user's step (with its hooks inside the optimizer step,
  ``step_hooks``, and after it, ``after_step``; and in reduced precision once more, ``precision_path``) on
  this very batch (every physical chunk of it) with examples removed or replaced (whole units: a user's
  rows, an example's views).
* **each release** (:meth:`RunChecks.before_release`): no parameter was written during the step; buffers
  the forward wrote are ones a check showed to be independent of the batch (else the next step is checked).
* **after each optimizer step** (:meth:`RunChecks.after_step`): the state later writes are measured from.
* **each step's per-example gradients, before they are used** (:class:`~lightning_dp.checks.capture.
  CaptureObligations`, at set-up too): every trainable parameter has a per-example path and its whole
  gradient comes through it (``coverage``); every layer call's rows are the batch's examples, once, in order,
  unmixed (``batch_rows``). The capture's hooks, floors below, observe; they are handed these checks
  (``per_example.observations``), which the package installs at import.

The engine's own release checks (one release per sampled batch, the per-example rows against the sampler's
draw, the budget, sequence-first layers at set-up) are in ``engine/``; resume checks in
``strategies/checkpoints.py``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn

from lightning_dp.checks.changes import ChangeWatch
from lightning_dp.checks.dry_flag import checking
from lightning_dp.checks.integrity import BatchIntegrity
from lightning_dp.checks.mixing import DEFAULT_OVERHEAD, CheckSetting, MixingCheck, MixingResult
from lightning_dp.checks.state import StateWatch
from lightning_dp.checks.structure import probe_batch_structure
from lightning_dp.checks.user_step import training_step_loss
from lightning_dp.core.batches import EmptyBatch, UnitInfo
from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.engine import PrivateStepEngine

__all__ = [
    "CheckSetting",
    "MixingResult",
    "RunChecks",
    "checking",
    "refuse_self_writing_layers",
    "training_step_loss",
]


def refuse_self_writing_layers(module: nn.Module) -> None:
    """Refuse layers whose forward writes their own weights from the batch (before any batch is seen)."""
    for name, layer in module.named_modules():
        if isinstance(layer, nn.Embedding | nn.EmbeddingBag) and layer.max_norm is not None:
            raise DPConfigurationError(
                f"Layer {name or '<root>'!r} ({type(layer).__name__}) has max_norm={layer.max_norm}: its forward "
                "renormalises the looked-up rows of its weight in place, so which rows the private batch "
                "touched is written into the model without noise. Build it without max_norm (clip or penalise "
                "the embeddings' norm in the loss instead)."
            )


@dataclass
class RunChecks:
    """The run-time checks of one strategy (see the module docstring for the moments)."""

    mixing: MixingCheck = field(default_factory=MixingCheck)
    integrity: BatchIntegrity = field(default_factory=BatchIntegrity)
    isolate_examples: bool = False
    public_buffers: tuple[str, ...] = ()
    unit: str = "example"
    """What the run's privacy unit is called in refusals ("example" or "user")."""
    state: StateWatch | None = None
    changes: ChangeWatch = field(default_factory=ChangeWatch)
    checked_after_change: int = 0
    """Batches checked because an epoch started or something the run can see changed (``changes``)."""
    _checked_this_step: bool = False

    @classmethod
    def build(
        cls,
        setting: CheckSetting,
        overhead: float = DEFAULT_OVERHEAD,
        seed: int | None = None,
        isolate_examples: bool = False,
        public_buffers: tuple[str, ...] = (),
        unit: str = "example",
    ) -> RunChecks:
        return cls(
            MixingCheck(setting, overhead, seed), BatchIntegrity(), isolate_examples, public_buffers, unit
        )

    # -- set-up -------------------------------------------------------------------------------------------
    def setup(self, module: nn.Module, convert_input: Any) -> None:
        """At fit start, before any batch: structural refusals, and the baseline of the module's state."""
        refuse_self_writing_layers(module)
        self.state = StateWatch(module, self.public_buffers)
        self.integrity = BatchIntegrity(convert_input=convert_input)
        self.changes.start_fit()
        self.mixing.start_fit()  # the state's baseline is taken at the first batch (after DDP's broadcast
        # of rank 0's weights and a resume's restore, which write the parameters on purpose)

    @contextmanager
    def _counted(self) -> Iterator[None]:
        """Every moment's time (the mixing check's runs included) counts against the budget the mixing
        check schedules itself by (``check_overhead``): the checks together stay within it."""
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.mixing.seconds_checking += time.perf_counter() - begin

    # -- each sampled batch, before user code ---------------------------------------------------------------
    def before_user_code(
        self,
        engine: PrivateStepEngine,
        module: LightningModule,
        trainer: Trainer | None,
        batch: Any,
        batch_idx: int,
        chunks: Sequence[tuple[Any, UnitInfo | None]],
        precision: Any,
        device: torch.device,
    ) -> None:
        """``batch``: what training_step receives; ``chunks``: what each forward sees (the batch, or every
        physical chunk under virtual batching), each with its privacy units (a user's rows, an example's
        augmented views; None: every row is its own unit). Raises before user code runs when a check fails."""
        with self._counted():
            self._checked_this_step = False
            if engine.grads is not None and engine.train_data is not None:  # structure, not a check: always
                dataset, collate = engine.train_data
                probe_batch_structure(engine.grads, module, dataset, collate, device, precision)
            self.integrity.check(batch, module, trainer)
            if self.state is not None:
                self.state.between_steps()
            self._watch_changes(module, trainer, engine)
            if isinstance(batch, EmptyBatch):
                return
            if not self.isolate_examples and self.mixing.due():
                results = self.mixing.run(engine, module, chunks, batch_idx, precision, device, self.unit)
                self._checked_this_step = results is not None
            if self.state is not None:
                self.state.at_entry()

    def _watch_changes(
        self, module: LightningModule, trainer: Trainer | None, engine: PrivateStepEngine
    ) -> None:
        """The first batch of an epoch, or after a change the run can see, is checked (``changes``)."""
        if not self.mixing.enabled or self.isolate_examples:
            return
        written = self.state.written_between if self.state is not None else []
        if self.changes.observe(module, trainer, engine, written) and not self.mixing.due_next:
            self.mixing.due_next = True
            self.checked_after_change += 1

    # -- each release -------------------------------------------------------------------------------------
    def before_release(self) -> None:
        """Before the noisy release: no parameter written during the step; forward-written buffers checked."""
        if self.state is None:
            return
        with self._counted():
            unverified = self.state.before_release(self._checked_this_step)
        if unverified and self.isolate_examples:
            raise DPConfigurationError(
                f"The buffers {unverified} were written in the forward with isolate_examples=True: the examples "
                "of a batch run through training_step one after another, so a buffer one example writes is "
                "read by the next, and no check runs to show it does not depend on the batch. Keep buffers "
                "constant in the forward, or, if they are computed only from the weights or the step count "
                "(a power iteration, a counter), declare them: DPStrategy(checks=Checks(public_buffers=[...]))."
            )
        if unverified and self.mixing.enabled:
            self.mixing.due_next = True  # verify them on the next batch, before its release

    def after_closure(self) -> None:
        """After ``on_before_optimizer_step``, before the weights move: what the hooks wrote since the release."""
        if self.state is not None:
            with self._counted():
                self.state.after_closure()

    # -- after each optimizer step -----------------------------------------------------------------------------
    def after_step(self) -> None:
        if self.state is not None:
            with self._counted():
                self.state.after_step()

    def summary(self) -> dict[str, Any]:
        """For the privacy report: what was checked, when, and what could not be verified."""
        out: dict[str, Any] = {
            "mixing": {
                **self.mixing.summary(),
                "isolate_examples": self.isolate_examples,
                "checked_after_a_change": self.checked_after_change,
            },
            "batch_integrity": {"batches_compared": self.integrity.checked},
        }
        if self.state is not None:
            out["state_writes"] = self.state.summary()
        return out
