"""Writes to the model's parameters and buffers that are not the optimizer step.

The released gradient moves the weights only through the optimizer. Anything else that writes the model
from a private batch is a release with no noise: a layer that renormalises its own rows in forward
(``nn.Embedding(max_norm=...)``), a running mean or a queue of the batch's features kept in a buffer and
saved with the model. Every step, the in-place version counters of every parameter and buffer are read
(no values, no copies; microseconds):

* a parameter written during the step (from the batch reaching user code to the release) is refused;
  parameters written between steps (an EMA teacher, weight clamping in ``on_train_batch_end``) are
  functions of released weights and pass;
* a buffer written between steps (``on_train_batch_end``, a callback, ``on_train_batch_start``) is refused,
  unless declared in ``public_buffers`` (the user states it is computed from the weights, the step count or
  public constants: post-processing, covered);
* a buffer written during the step (in the forward) must be shown not to depend on the batch: the mixing
  check compares it between its two passes (a power iteration's vector, a forward counter pass; a running
  statistic does not). A buffer first written on an unchecked step makes the next step a checked one.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from lightning_dp.errors import DPConfigurationError

Versions = dict[str, tuple[int, int]]


def _versions(named: Sequence[tuple[str, object]]) -> Versions:
    return {name: (id(t), t._version) for name, t in named}  # type: ignore[attr-defined]


def _changed(before: Versions, after: Versions) -> list[str]:
    return sorted(name for name, v in after.items() if before.get(name) != v)


@dataclass
class StateWatch:
    """Version counters of ``module``'s parameters and buffers at the named moments of a step."""

    module: nn.Module
    public_buffers: tuple[str, ...] = ()
    verified_buffers: set[str] = field(default_factory=set)
    """Buffers the forward writes that a mixing check found independent of the batch."""
    unverified_buffers: set[str] = field(default_factory=set)
    """Buffers the forward wrote on a step no check covered, not yet seen on a checked step."""
    _after_step: tuple[Versions, Versions] | None = None
    _at_entry: tuple[Versions, Versions] | None = None

    def _now(self) -> tuple[Versions, Versions]:
        return _versions(list(self.module.named_parameters())), _versions(list(self.module.named_buffers()))

    def _public(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.public_buffers)

    def after_step(self) -> None:
        """After the optimizer step (and at fit start): the state every later write is measured against
        (under manual optimization the step may come inside training_step, before another release)."""
        self._after_step = self._at_entry = self._now()

    def between_steps(self) -> None:
        """Before user code runs on a batch: refuse buffers written since the last step (hooks, callbacks)."""
        if self._after_step is None:  # the first batch of the fit: the baseline
            self._after_step = self._now()
            return
        _, buffers = self._now()
        written = [n for n in _changed(self._after_step[1], buffers) if not self._public(n)]
        if written:
            raise DPConfigurationError(
                f"The buffers {written} were written between two training steps (in on_train_batch_end, "
                "on_train_batch_start, a Callback or another hook), not by the optimizer: a running mean, a "
                "queue or any statistic of the private batches kept in a buffer is released with the model "
                "(and saved in every checkpoint) without noise, and the examples it holds reach the next "
                "steps' gradients, so ε does not cover it. Compute such statistics from public data, keep "
                "them out of the model, or, if the buffers are computed only from the weights, the step count "
                "or public constants (an EMA of the weights, a counter), declare them: "
                "DPStrategy(public_buffers=[...names or patterns...])."
            )

    def at_entry(self) -> None:
        """Right before the real step's user code (after any check): the state the step starts from."""
        self._at_entry = self._now()

    def before_release(self, checked: bool) -> list[str]:
        """Before the release: refuse parameters written during the step; return the buffers the forward
        wrote that no check has shown to be independent of the batch (the next step must be checked)."""
        if self._at_entry is None:
            return []
        params, buffers = self._now()
        written_params = _changed(self._at_entry[0], params)
        if written_params:
            from lightning_dp.checks.mixing import parameter_write_message

            raise DPConfigurationError(parameter_write_message(written_params, "the training step"))
        written = [n for n in _changed(self._at_entry[1], buffers) if not self._public(n)]
        if checked:
            self.verified_buffers |= set(written)
            self.unverified_buffers -= set(written)
        new = [n for n in written if n not in self.verified_buffers]
        self.unverified_buffers |= set(new)
        return new

    def summary(self) -> dict[str, list[str]]:
        return {
            "buffers_written_in_forward_verified": sorted(self.verified_buffers),
            "buffers_written_in_forward_unverified": sorted(self.unverified_buffers),
            "public_buffers": list(self.public_buffers),
        }
