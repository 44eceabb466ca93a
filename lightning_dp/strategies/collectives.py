"""User code's collectives inside the private step (``dp_ddp``, ``dp_fsdp``): they meet, and only real data enters.

Each rank draws its own Poisson batch, so the ranks would make different numbers of ``training_step`` calls
per step (an empty batch makes none, virtual batching a number of its own), and a collective in user code
would wait on some ranks forever: ``self.log(..., sync_dist=True)``, which Lightning reduces at log time
through ``strategy.reduce``, or a manual step's release. So every rank makes the same number of calls: a
rank with fewer makes *placeholder calls* (:class:`~lightning_dp.strategies.lockstep.Placeholders`), and
:class:`StepCollectives` knows which kind of call runs, so that what user code syncs counts real data only:

* ``strategy.reduce`` in a call reduces over the ranks whose call has real data, in one all-reduce of
  (value, present): the mean is Σ value / Σ present, the sum Σ value, max and min over those ranks; a
  placeholder call makes the same all-reduce with present = 0 and sends zeros, never its own value.
* ``self.log`` in a placeholder call writes to a scratch collection. The run's keeps only what every rank
  shares: a synced on-step value (the mean over the ranks with data), and an on-epoch key, with nothing
  accumulated, so that every rank syncs it at the epoch's end.
* ``all_gather`` and ``broadcast`` in a call or in a check's dry pass are refused: they would hand one rank's
  examples to another rank's step, which no per-example bound covers. In a check's dry pass (each rank makes
  its own), ``reduce`` returns the local value and ``barrier`` waits for nobody.

Reads Lightning 2.6's result collection (``trainer.fit_loop.epoch_loop._results``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection, _ResultMetric
from torch import Tensor

from lightning_dp.checks.dry_flag import checking
from lightning_dp.core.errors import DPConfigurationError

REAL = "real"
"""A ``training_step`` call on this rank's own examples, in the private step."""
PLACEHOLDER = "placeholder"
"""A call that stands in for one this rank lacks: it adds nothing, and its collectives send nothing."""

_GATHER_REFUSAL = (
    "{what} was called inside training_step (or a hook a check re-runs) under a distributed private strategy: "
    "it would hand one rank's examples to another rank's step, where no per-example clipping bounds them, and "
    "a placeholder call (made by a rank with fewer chunks or an empty batch) would send a value of its own. "
    "Sync what you log with self.log(..., sync_dist=True), which is reduced over the ranks whose call has "
    "data, or gather in on_train_batch_end or on_train_epoch_end, outside the private step."
)


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


class StepCollectives:
    """Which kind of ``training_step`` call runs now (:data:`REAL`, :data:`PLACEHOLDER`, or None: none of
    the private step's), and what ``strategy.reduce``, ``all_gather``, ``broadcast`` and ``barrier`` do in it.

    Args:
        device: where the all-reduce runs (the strategy's root device: NCCL needs a CUDA tensor).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.role: str | None = None
        self._unmet: set[int] = set()
        """The results of this placeholder call's reduces that no rank had data for (their logs are dropped)."""

    @contextmanager
    def call(self, role: str) -> Iterator[None]:
        """The block is one ``training_step`` call of ``role``."""
        saved, self.role = self.role, role
        try:
            yield
        finally:
            self.role = saved

    def reduce(self, tensor: Any, group: Any, reduce_op: Any, plain: Callable[..., Any]) -> Any:
        """``strategy.reduce``: over the ranks with real data inside a call, local in a check's dry pass,
        ``plain`` (Lightning's) elsewhere."""
        if not isinstance(tensor, Tensor) or not distributed():
            return plain(tensor, group=group, reduce_op=reduce_op)
        if self.role is None:
            if checking():
                return tensor
            if not tensor.is_floating_point() and _is_mean(reduce_op):
                tensor = (
                    tensor.double()
                )  # Lightning's mean of an integer (an epoch's batch sizes) would truncate
            return plain(tensor, group=group, reduce_op=reduce_op)
        result, met = self._present_reduce(tensor, group, _reduction(reduce_op))
        if not met:
            self._unmet.add(id(result))
        return result

    def _present_reduce(self, tensor: Tensor, group: Any, kind: str) -> tuple[Tensor, bool]:
        """One all-reduce of (value, present) over ``group``: the ``kind`` reduction over the ranks with data,
        and whether any had some."""
        present = self.role == REAL
        values = tensor.detach().reshape(-1).to(device=self.device, dtype=torch.float64)
        if not present:  # sends nothing of its own (not value·0: an infinite value would give NaN)
            fill = {"max": -math.inf, "min": math.inf}.get(kind, 0.0)
            values = torch.full_like(values, fill)
        flag = torch.full((1,), 1.0 if present else 0.0, dtype=torch.float64, device=self.device)
        op = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}.get(kind, dist.ReduceOp.SUM)
        payload = torch.cat([values, -flag if kind == "min" else flag])
        dist.all_reduce(payload, op=op, group=group)
        out, count = payload[:-1], abs(float(payload[-1]))
        if kind == "mean":
            out = out / max(count, 1.0)
        if count == 0:
            out = torch.full_like(out, math.nan)
        result = out.reshape(tensor.shape).to(tensor.device)
        if tensor.is_floating_point() or kind != "mean":
            result = result.to(tensor.dtype)
        return result, count > 0

    def refuse_gather(self, what: str) -> None:
        """``all_gather`` or ``broadcast`` in a call or a dry pass: refused by name."""
        if self.role is not None or checking():
            raise DPConfigurationError(_GATHER_REFUSAL.format(what=what))

    def waits(self) -> bool:
        """Whether ``barrier`` waits: not in a check's dry pass (the other ranks make their own)."""
        return self.role is not None or not checking()

    @contextmanager
    def placeholder_logs(self, module: LightningModule) -> Iterator[None]:
        """``self.log`` in a placeholder call: into a scratch collection; the run's keeps what every rank shares."""
        trainer = module._trainer
        loop: Any = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        kept = getattr(loop, "_results", None)
        if trainer is None or not isinstance(kept, _ResultCollection) or trainer._results is not kept:
            yield
            return
        connector = trainer._logger_connector
        current_fx = connector._current_fx
        scratch = _ResultCollection(training=True)
        self._unmet.clear()
        loop._results = scratch
        try:
            yield
            keep_shared_logs(scratch, kept, self._unmet)
        finally:
            loop._results = kept
            connector._current_fx = current_fx
            self._unmet.clear()


def _is_mean(reduce_op: Any) -> bool:
    return (isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")) or (
        not isinstance(reduce_op, str) and reduce_op is not None and reduce_op == dist.ReduceOp.AVG
    )


def _reduction(reduce_op: Any) -> str:
    """``reduce_op`` (Lightning's string, torch's ``ReduceOp`` or None: torch's default, a sum) as one of
    mean, sum, max, min; another (a product, a bitwise op) cannot leave placeholders out: refused."""
    if reduce_op is None:
        return "sum"
    if isinstance(reduce_op, str):
        name = reduce_op.lower()
        name = "mean" if name == "avg" else name
        if name in ("mean", "sum", "max", "min"):
            return name
    else:
        ops = dist.ReduceOp
        for name, op in (("sum", ops.SUM), ("max", ops.MAX), ("min", ops.MIN), ("mean", ops.AVG)):
            if reduce_op == op:
                return name
    raise DPConfigurationError(
        f"strategy.reduce(..., reduce_op={reduce_op!r}) inside training_step under a distributed private "
        "strategy: only mean, sum, max and min can be taken over the ranks whose call has data (the others "
        "make placeholder calls that must not count). Reduce with one of those."
    )


def keep_shared_logs(scratch: _ResultCollection, kept: _ResultCollection, unmet: set[int]) -> None:
    """What a placeholder call's ``self.log`` leaves in the run's collection ``kept``: each synced on-step value
    (the mean over the ranks with data: every rank holds the same), and each on-epoch key that is synced at the
    epoch's end (``sync_dist``, or a torchmetrics object), registered with nothing accumulated."""
    for key, logged in scratch.items():
        meta = logged.meta
        syncs = meta.sync.should and not meta.sync.rank_zero_only
        step = meta.on_step and logged.is_tensor and syncs and id(logged._forward_cache) not in unmet
        epoch = meta.on_epoch and (syncs or not logged.is_tensor)
        if not (step or epoch):
            continue
        entry = kept.get(key)
        if entry is None:
            entry = kept[key] = _ResultMetric(meta, logged.is_tensor)
            entry.to(logged.value.device if logged.is_tensor else logged.device)
            if not logged.is_tensor:  # the user's metric object (its state as the placeholder call found it)
                entry.value = logged.value
        elif entry.meta != meta:
            continue  # the next real self.log of the key reports the mismatch in Lightning's words
        if step:
            entry._forward_cache = logged._forward_cache
            if not meta.on_epoch:
                entry.value = logged._forward_cache
        if (
            epoch and logged.is_tensor
        ):  # in the dtype real values promote it to (fp64): the epoch's syncs alike
            entry.value = entry.value.to(logged.value.dtype)
        entry.has_reset = False
        entry._update_count = max(int(getattr(entry, "_update_count", 0)), 1)  # computed at the epoch's end
