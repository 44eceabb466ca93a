"""Every rank makes the same forward and backward passes (``dp_fsdp``), so FSDP2's collectives always meet.

FSDP2 all-gathers each unit's parameters in every forward and every backward: a collective that waits for
every rank. Per-rank Poisson batches and the run-time checks give the ranks different work (an empty local
batch, more physical chunks, a check's dry passes on one rank only), so :class:`Lockstep` keeps the passes
in step. A *pass* is one call of the LightningModule's ``training_step`` and the backward of what it
returns; lightning-dp's own calls (the checks' dry passes, the structure probe) are passes too.

* A pass whose outputs no backward reached (``training_step`` returned no loss, or a loss that does not
  reach the model) is closed with a backward of zeros from the model's outputs, so it makes the backward's
  collectives like every other pass; then every unit is resharded (a forward-only pass leaves the root
  unit gathered), so each pass starts from the same state on every rank.
* Inside a :meth:`Lockstep.window` (a run-time check), each pass a rank starts is announced with one small
  all-reduce. A rank that has made all its own passes answers each announcement with a placeholder pass,
  until no rank announces one: ranks may check different steps and make different numbers of dry passes.
* :meth:`Lockstep.placeholder_pass` runs the user's ``training_step`` as a dry pass (nothing logged,
  stepped or kept; :mod:`lightning_dp.checks.user_step`) on one training example, then forgets its
  per-example gradients: it adds nothing to the released sum, to the norms or to any check.

The strategy adds the real step's part: the ranks agree on the number of physical chunks (the largest),
and a rank with fewer (an empty batch has none) runs placeholder passes that contribute zero sums.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from lightning_dp.checks.dry_flag import checking
from lightning_dp.checks.snapshot import ModuleState
from lightning_dp.checks.user_step import dry_training_step
from lightning_dp.core.batches import batch_length
from lightning_dp.per_example import GradientCapture

_OUT_OF_STEP = (
    "dp_fsdp: the ranks started different kinds of passes at once (one with gradients, one without): "
    "FSDP2's collectives would not meet. A training_step or hook whose use of torch.no_grad() depends on "
    "the rank or the batch cannot run sharded; keep it the same on every rank."
)


def _backpropagates(output: Any) -> bool:
    """Whether a backward follows this ``training_step`` output (a loss that requires grad)."""
    loss = output.get("loss") if isinstance(output, Mapping) else output
    return isinstance(loss, Tensor) and loss.requires_grad


class Lockstep:
    """The passes of one fit under ``dp_fsdp`` (see the module docstring).

    Args:
        module: the LightningModule whose ``training_step`` calls are the passes.
        roots: the outermost FSDP2 modules: a backward that reached none of their outputs did not run.
        settle: called after each pass: every FSDP2 unit resharded.
        forget_grads: drops the full-size non-private gradients a dry pass left on FSDP2's parameters.
        capture: the per-example gradient hooks (None before they are attached).
        placeholder: one training example, collated (what a placeholder pass runs on).
        precision: the precision plugin (how a dry pass converts the batch and enters the step's context).
        device: where the agreements' small all-reduces run.
    """

    def __init__(
        self,
        module: LightningModule,
        roots: Sequence[nn.Module],
        settle: Callable[[], None],
        forget_grads: Callable[[], None],
        capture: Callable[[], GradientCapture | None],
        placeholder: Callable[[], Any],
        precision: Any,
        device: torch.device,
    ) -> None:
        self.module, self.roots = module, list(roots)
        self._settle, self._forget_grads, self._capture = settle, forget_grads, capture
        self._placeholder, self._batch = placeholder, None
        self.precision, self.device = precision, device
        self.passes = 0
        """Passes this rank made (its own and placeholders)."""
        self.placeholders = 0
        """Of those, placeholder passes (they contributed nothing)."""
        self._open = False
        self._grad = False
        self._outputs: list[Tensor] = []
        self._reached = False
        self._windowed = False
        self._draining = False
        self._handles: list[RemovableHandle] = []
        self._user_step: Callable[..., Any] | None = None

    # -- installing ---------------------------------------------------------------------------------------
    def install(self) -> None:
        """Every ``training_step`` call (Lightning's, a check's, a placeholder's) becomes a pass."""
        if self._user_step is not None:
            return
        self._user_step = user_step = self.module.training_step

        @functools.wraps(user_step)
        def step(*args: Any, **kwargs: Any) -> Any:
            self.begin()
            output = user_step(*args, **kwargs)
            if checking() and not _backpropagates(output):  # a dry pass no backward follows: closed now,
                self.close()  # before the check reads the parameters (the real step's waits for the ranks)
            return output

        self.module.__dict__["training_step"] = step
        self._handles = [root.register_forward_hook(self._on_output) for root in self.roots]

    def remove(self) -> None:
        self.close()
        if self._user_step is not None:
            self.module.__dict__.pop("training_step", None)
            self._user_step = None
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._batch = None

    # -- one pass ------------------------------------------------------------------------------------------
    def begin(self) -> None:
        """A pass starts: the previous one is closed; inside a window, announced to the other ranks."""
        self.close()
        grad = torch.is_grad_enabled()
        if self._windowed and not self._draining:
            flags = self._all_reduce_max([1, int(grad), int(not grad)])
            if flags[1] and flags[2]:
                raise RuntimeError(_OUT_OF_STEP)
        self._open, self._grad, self._outputs, self._reached = True, grad, [], False
        self.passes += 1

    def _on_output(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._open or not self._grad or torch._C._current_graph_task_id() != -1:
            return  # no pass, no graph, or a forward recomputed in backward (activation checkpointing)
        for t in tree_flatten(output)[0]:
            if isinstance(t, Tensor) and t.requires_grad:
                t.register_hook(self._mark)
                self._outputs.append(t)

    def _mark(self, grad: Tensor) -> None:
        self._reached = True

    def close(self) -> None:
        """End the open pass: a backward of zeros from the model's outputs if none ran, then reshard."""
        if not self._open:
            return
        self._open = False
        outputs, self._outputs = self._outputs, []
        if self._grad and outputs and not self._reached:
            torch.autograd.backward(outputs, [torch.zeros_like(t) for t in outputs])
        self._settle()

    # -- the checks: announced passes -----------------------------------------------------------------------
    @contextmanager
    def window(self) -> Iterator[None]:
        """Passes started in the block are announced; at its end, placeholders answer the other ranks' passes."""
        if self._windowed:
            yield
            return
        self._windowed = True
        try:
            yield
        finally:
            self._windowed = False
            self.drain()

    def drain(self) -> None:
        """Answer every pass another rank still announces with a placeholder pass of the same kind."""
        self._draining = True
        try:
            while True:
                self.close()
                flags = self._all_reduce_max([0, 0, 0])
                if not flags[0]:
                    break
                if flags[1] and flags[2]:
                    raise RuntimeError(_OUT_OF_STEP)
                self.placeholder_pass(grad=bool(flags[1]))
        finally:
            self._draining = False
            self._forget_grads()

    # -- the real step: an agreed number of chunks ---------------------------------------------------------
    def agree_max(self, value: int) -> int:
        """The largest ``value`` over the ranks."""
        return self._all_reduce_max([value])[0]

    def placeholder_pass(self, grad: bool = True) -> None:
        """A dry pass of ``training_step`` on one training example whose per-example gradients are thrown
        away: the same collectives as any pass, nothing added to the sums, the norms or the checks."""
        capture = self._capture()
        hint = capture._batch_hint if capture is not None else None
        batch = self._placeholder_batch()
        state = ModuleState.save(self.module, self.device)
        try:
            if capture is not None:
                capture.expect_batch(batch_length(batch))
            with torch.set_grad_enabled(grad):
                dry_training_step(self.module, batch, 0, self.precision, forward_only=not grad)
                self.close()
        finally:
            state.restore()
            if capture is not None:
                capture.discard()
                capture.expect_batch(hint)
            self._forget_grads()
        self.placeholders += 1

    def _placeholder_batch(self) -> Any:
        if self._batch is None:
            self._batch = move_data_to_device(self.precision.convert_input(self._placeholder()), self.device)
        return self._batch

    def _all_reduce_max(self, values: list[int]) -> list[int]:
        flags = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return [int(v) for v in flags.tolist()]
