"""Writes to the model's parameters and buffers that are not the optimizer step.

The released gradient moves the weights only through the optimizer. Anything else that writes the model
from a private batch is a release with no noise: a layer that renormalises its own rows in forward
(``nn.Embedding(max_norm=...)``), a running mean or a queue of the batch's features kept in a buffer and
saved with the model. Every step, each parameter and buffer is read by identity, storage address and
in-place version counter (``set_`` and ``p.data = ...`` move the address), and each buffer also by value
(a checksum of all its values, one fused reduction: a write through ``.data``, which no version counter
sees, still moves it). Parameters are compared value by value, against a full copy, wherever lightning-dp
runs user code on a batch itself: the structure probe (the first code to see a training record, so a
data-dependent initialisation is caught there) and both passes of every mixing check:

* a parameter written during the step (from the batch reaching user code to the release) is refused,
  unless it is frozen (``requires_grad=False``: an EMA copy updated in ``training_step``), which is then
  treated like a buffer written in the forward (below); parameters written between steps (an EMA teacher, weight clamping in ``on_train_batch_end``) are
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
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_dp.checks.snapshot import _owner, same_values
from lightning_dp.core.errors import DPConfigurationError

Entry = tuple[int, int, int, float | None]
"""(object id, storage address, in-place version, value checksum or None where not read) of one tensor."""


def checksums(tensors: list[Tensor]) -> list[float]:
    """One number per tensor computed from every value it holds (its L2 norm, in one fused call for the
    floating tensors; about one read of the weights): a write that bypasses the version counter
    (``p.data.copy_``, ``p.data[...] = ...``) still moves it. NaN where a value is NaN (equal to itself)."""
    if not tensors:
        return []
    floating = [i for i, t in enumerate(tensors) if t.is_floating_point() or t.is_complex()]
    out = [0.0] * len(tensors)
    chosen = set(floating)
    with torch.no_grad():
        if floating:
            norms = torch._foreach_norm([tensors[i].detach() for i in floating], 2)
            for i, v in zip(floating, torch.stack([n.double().cpu() for n in norms]).tolist(), strict=True):
                out[i] = v
        for i, t in enumerate(tensors):
            if i not in chosen and t.numel():
                out[i] = float(t.detach().double().square().sum())
    return out


def entries(tensors: Iterable[Tensor | None], values: bool = True) -> list[Entry]:
    """The :data:`Entry` of each tensor (``(0, 0, 0, 0.0)`` for a missing one); checksums only if
    ``values``."""
    listed = list(tensors)
    present = [t for t in listed if t is not None]
    sums = iter(checksums(present) if values else [None] * len(present))
    return [
        (id(t), t.data_ptr(), t._version, next(sums)) if t is not None else (0, 0, 0, 0.0) for t in listed
    ]


def _same(a: Entry | None, b: Entry) -> bool:
    """The same object, storage and version, and the same checksum where both were read (NaN == NaN)."""
    if a is None or a[:3] != b[:3]:
        return False
    x, y = a[3], b[3]
    return x is None or y is None or x == y or (x != x and y != y)


@dataclass
class _Snapshot:
    """The :data:`Entry` of every parameter and buffer, in a fixed order, with their names: comparing two
    is a list comparison; names are matched only when something changed."""

    param_names: list[str]
    params: list[Entry]
    buffer_names: list[str]
    buffers: list[Entry]


def _changed(before_names: list[str], before: list[Entry], names: list[str], after: list[Entry]) -> list[str]:
    """Names whose tensor was written (in place, through ``.data`` or ``set_``) or replaced, or that
    appeared, between the two snapshots."""
    if before_names is names and before == after:
        return []
    previous = dict(zip(before_names, before, strict=True))
    return sorted(n for n, v in zip(names, after, strict=True) if not _same(previous.get(n), v))


@dataclass
class StateWatch:
    """Version counters of ``module``'s parameters and buffers at the named moments of a step."""

    module: nn.Module
    public_buffers: tuple[str, ...] = ()
    verified_buffers: set[str] = field(default_factory=set)
    """Buffers the forward writes that a mixing check found independent of the batch."""
    unverified_buffers: set[str] = field(default_factory=set)
    """Buffers the forward wrote on a step no check covered, not yet seen on a checked step."""
    written_between: list[str] = field(default_factory=list)
    """The parameters and buffers written between the last two steps, not by the optimizer (an EMA, a
    clamp, a reset in ``on_train_batch_end``): a callback that starts writing makes the next batch a checked
    one (``checks/changes.py``)."""
    _after_step: _Snapshot | None = None
    _at_entry: _Snapshot | None = None
    _released: _Snapshot | None = None
    """The state at the release, until :meth:`after_closure` reads what the hooks after it wrote."""
    _written_after_release: list[str] = field(default_factory=list)
    _modules: list[tuple[str, nn.Module]] = field(default_factory=list)
    _layout: (
        tuple[int, list[tuple[dict[str, Any], str]], list[str], list[tuple[dict[str, Any], str]], list[str]]
        | None
    ) = None

    def __post_init__(self) -> None:
        self._modules = list(self.module.named_modules())

    def _where(
        self,
    ) -> tuple[list[tuple[dict[str, Any], str]], list[str], list[tuple[dict[str, Any], str]], list[str]]:
        """Where each parameter and buffer lives (its module's dict and key), read again only when the number
        of entries changes: a buffer the forward replaces (``self.mask = ...``) is a new object in place."""
        count = sum(len(m._parameters) + len(m._buffers) for _, m in self._modules)
        if self._layout is None or self._layout[0] != count:
            slots: list[tuple[dict[str, Any], str]] = []
            names: list[str] = []
            buffer_slots: list[tuple[dict[str, Any], str]] = []
            buffer_names: list[str] = []
            for prefix, m in self._modules:
                for key in m._parameters:
                    slots.append((m._parameters, key))
                    names.append(f"{prefix}.{key}" if prefix else key)
                for key in m._buffers:
                    buffer_slots.append((m._buffers, key))
                    buffer_names.append(f"{prefix}.{key}" if prefix else key)
            self._layout = (count, slots, names, buffer_slots, buffer_names)
        return self._layout[1:]

    def _now(self) -> _Snapshot:
        """Every entry: parameters by identity, storage and version (their values are compared where user
        code runs on a batch inside the checks: the structure probe and every checked batch's passes, by
        a full copy), buffers also by a checksum of their values."""
        slots, names, buffer_slots, buffer_names = self._where()
        params = entries((d.get(k) for d, k in slots), values=False)
        return _Snapshot(names, params, buffer_names, entries(d.get(k) for d, k in buffer_slots))

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
        now = self._now()
        before = self._after_step
        changed = _changed(before.buffer_names, before.buffers, now.buffer_names, now.buffers)
        self.written_between = _changed(before.param_names, before.params, now.param_names, now.params)
        self.written_between += changed + self._written_after_release
        self._written_after_release = []
        written = [n for n in changed if not self._public(n)]
        if written:
            raise DPConfigurationError(
                f"The buffers {written} were written between two training steps (in on_train_batch_end, "
                "on_train_batch_start, a Callback or another hook), not by the optimizer: a running mean, a "
                "queue or any statistic of the private batches kept in a buffer is released with the model "
                "(and saved in every checkpoint) without noise, and the examples it holds reach the next "
                "steps' gradients, so ε does not cover it. Compute such statistics from public data, keep "
                "them out of the model, or, if the buffers are computed only from the weights, the step count "
                "or public constants (an EMA of the weights, a counter), declare them: "
                "DPStrategy(checks=Checks(public_buffers=[...names or patterns...]))."
            )

    def at_entry(self) -> None:
        """Right before the real step's user code (after any check): the state the step starts from."""
        self._at_entry = self._now()

    def before_release(self, checked: bool) -> list[str]:
        """Before the release: refuse parameters written during the step; return the buffers the forward
        wrote that no check has shown to be independent of the batch (the next step must be checked)."""
        if self._at_entry is None:
            return []
        now = self._released = self._now()
        entry = self._at_entry
        written_params = _changed(entry.param_names, entry.params, now.param_names, now.params)
        frozen = set(self.frozen_parameters()) if written_params else set()  # only when a step wrote one
        trained = [n for n in written_params if n not in frozen]
        if trained:
            raise DPConfigurationError(parameter_write_message(trained, "the training step"))
        changed = _changed(entry.buffer_names, entry.buffers, now.buffer_names, now.buffers)
        changed += [n for n in written_params if n in frozen]  # frozen parameters count as buffers
        written = [n for n in changed if not self._public(n)]
        if checked:
            self.verified_buffers |= set(written)
            self.unverified_buffers -= set(written)
        new = [n for n in written if n not in self.verified_buffers]
        self.unverified_buffers |= set(new)
        return new

    def after_closure(self) -> None:
        """Once ``on_before_optimizer_step`` ran, before the weights move: the parameters and buffers written
        since the release (the optimizer's own write would hide them from :meth:`between_steps`) count as
        written between steps, so a hook that starts writing them makes the next batch a checked one."""
        released, self._released = self._released, None
        if released is None:
            return
        now = self._now()
        self._written_after_release += _changed(
            released.param_names, released.params, now.param_names, now.params
        ) + _changed(released.buffer_names, released.buffers, now.buffer_names, now.buffers)

    def frozen_parameters(self) -> list[str]:
        """Parameters that take no gradient now (an EMA copy, a teacher): no optimizer trains them, so a write
        in the step is treated like a buffer's (it must not depend on the batch)."""
        return [name for name, p in self.module.named_parameters() if not p.requires_grad]

    def summary(self) -> dict[str, list[str]]:
        return {
            "buffers_written_in_forward_verified": sorted(self.verified_buffers),
            "buffers_written_in_forward_unverified": sorted(self.unverified_buffers),
            "public_buffers": list(self.public_buffers),
        }


@dataclass
class ParameterValues:
    """A copy of every parameter's values, taken before lightning-dp runs user code itself (a check's dry
    pass, the structure probe): afterwards, which parameters that code wrote, by value, however it wrote
    them (``.data``, ``copy_`` under ``no_grad``, ``set_``, a new object), and putting them back."""

    module: nn.Module
    saved: list[tuple[str, nn.Parameter, Tensor]] = field(default_factory=list)

    @classmethod
    def take(cls, module: nn.Module) -> ParameterValues:
        with torch.no_grad():
            return cls(module, [(n, p, _local(p).clone()) for n, p in module.named_parameters()])

    def written(self) -> list[str]:
        """Parameters whose values (or object) differ from the copy."""
        now = dict(self.module.named_parameters())
        return sorted(
            name
            for name, p, values in self.saved
            if now.get(name) is not p or not same_values(values, _local(p))
        )

    def written_by_kind(self) -> tuple[list[str], dict[str, Tensor]]:
        """:meth:`written`, split: the trained parameters written (``requires_grad``), and the frozen ones (an
        EMA copy, a teacher) with their new values: like buffers, they may be written in the step if not
        from the batch."""
        now = dict(self.module.named_parameters())
        trained: list[str] = []
        frozen: dict[str, Tensor] = {}
        for name in self.written():
            p = now.get(name)
            if p is not None and not p.requires_grad:
                frozen[name] = _local(p).clone()
            else:
                trained.append(name)
        return trained, frozen

    def restore(self) -> None:
        """Put every parameter object and its values back."""
        with torch.no_grad():
            for name, p, values in self.saved:
                owner, leaf = _owner(self.module, name)
                if owner._parameters.get(leaf) is not p:
                    owner._parameters[leaf] = p
                local = _local(p)
                if local.shape != values.shape or local.dtype != values.dtype:
                    local.data = values.clone()
                elif not same_values(values, local):
                    local.copy_(values)


def _local(p: Tensor) -> Tensor:
    """A parameter's own values on this rank, detached: an FSDP2 shard's local rows (comparing sharded
    DTensors would be a collective, which only some ranks' checks would make), else the tensor itself."""
    to_local = getattr(p, "to_local", None)  # a DTensor's
    return (to_local() if callable(to_local) else p).detach()


def parameter_write_message(names: list[str], where: str) -> str:
    """The refusal for parameters written in place during the step, naming the usual causes and the fix."""
    return (
        f"The parameters {names} were written in place during {where} (not by the optimizer step): a layer "
        "that changes its own weights from the batch in forward (nn.Embedding or nn.EmbeddingBag with max_norm, "
        "which renormalises the looked-up rows) or code that assigns to a parameter there writes private data "
        "into the model without noise, and the released gradient no longer describes the update. Remove "
        "max_norm (clip the embedding's output or penalise its norm in the loss instead), and change trained "
        "parameters only through the optimizer. A copy of the weights kept beside them (an EMA or SWA "
        "average, a teacher) is fine once it is frozen (requires_grad_(False)): it is then checked like a "
        "buffer, not to depend on the batch; or update it in on_train_batch_end or a callback."
    )
