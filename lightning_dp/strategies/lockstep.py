"""Every rank makes the same ``training_step`` calls, so that collectives always meet (``dp_ddp``, ``dp_fsdp``).

Per-rank Poisson batches give the ranks different work: an empty local batch, more physical chunks, and,
for the run-time checks, dry passes on one rank only. A collective made in a call (``self.log(...,
sync_dist=True)``, a manual step's release; under ``dp_fsdp`` FSDP2's all-gather in every forward and
backward) would wait on a rank that makes fewer. A *pass* is one call of the LightningModule's
``training_step`` and the backward of what it returns; lightning-dp's own calls (the checks' dry passes,
the structure probe) are passes too.

:class:`Placeholders` (both strategies) runs the *placeholder passes*: the user's ``training_step`` on one
training example, whose per-example gradients are thrown away, so it adds nothing to the released sum, to
the norms or to any check. The strategy agrees with the other ranks on the number of calls of the real step
(the largest number of physical chunks, :meth:`Placeholders.agree_max`), and a rank with fewer (an empty
batch has none) makes the missing ones as placeholder passes that *stand in* for real calls: their
collectives are the real calls' own, with nothing of their data (:mod:`~lightning_dp.strategies.collectives`),
and under manual optimization the call's release (noise alone) and optimizer steps are real.

:class:`Lockstep` (``dp_fsdp``) keeps every pass in step as well:

* A pass whose outputs no backward reached (``training_step`` returned no loss, or a loss that does not
  reach the model) is closed with a backward of zeros from the model's outputs, so it makes the backward's
  collectives like every other pass; then every unit is resharded (a forward-only pass leaves the root
  unit gathered), so each pass starts from the same state on every rank.
* Inside a :meth:`Lockstep.window` (a run-time check), each pass a rank starts is announced with one small
  all-reduce. A rank that has made all its own passes answers each announcement with a (dry) placeholder
  pass, until no rank announces one: ranks may check different steps and make different numbers of passes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
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
from lightning_dp.strategies.collectives import PLACEHOLDER, StepCollectives

_OUT_OF_STEP = (
    "dp_fsdp: the ranks started different kinds of passes at once (one with gradients, one without): "
    "FSDP2's collectives would not meet. A training_step or hook whose use of torch.no_grad() depends on "
    "the rank or the batch cannot run sharded; keep it the same on every rank."
)


def _backpropagates(output: Any) -> bool:
    """Whether a backward follows this ``training_step`` output (a loss that requires grad)."""
    loss = output.get("loss") if isinstance(output, Mapping) else output
    return isinstance(loss, Tensor) and loss.requires_grad


class Placeholders:
    """The placeholder passes of one fit under ``dp_ddp`` or ``dp_fsdp`` (see the module docstring).

    Args:
        module: the LightningModule whose ``training_step`` calls are the passes.
        capture: the per-example gradient hooks (None before they are attached).
        placeholder: one training example, collated (what a placeholder pass runs on).
        precision: the precision plugin (how a dry pass converts the batch and enters the step's context).
        device: where the agreements' small all-reduces run.
        collectives: which kind of call runs (a stand-in's collectives send nothing of its own).
    """

    def __init__(
        self,
        module: LightningModule,
        capture: Callable[[], GradientCapture | None],
        placeholder: Callable[[], Any],
        precision: Any,
        device: torch.device,
        collectives: StepCollectives,
    ) -> None:
        self.module, self._capture = module, capture
        self._placeholder, self._batch = placeholder, None
        self.precision, self.device, self.collectives = precision, device, collectives
        self.placeholders = 0
        """Placeholder passes this rank made (they contributed nothing)."""
        self._stand_in = False
        self._user_step: Callable[..., Any] | None = None

    # -- installing ---------------------------------------------------------------------------------------
    def install(self) -> None:
        """Every ``training_step`` call (Lightning's, a check's, a placeholder's) goes through :meth:`_call`."""
        if self._user_step is not None:
            return
        self._user_step = user_step = self.module.training_step

        @functools.wraps(user_step)
        def step(*args: Any, **kwargs: Any) -> Any:
            return self._call(user_step, args, kwargs)

        self.module.__dict__["training_step"] = step

    def remove(self) -> None:
        if self._user_step is not None:
            self.module.__dict__.pop("training_step", None)
            self._user_step = None
        self._batch = None

    def _call(self, user_step: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One ``training_step`` call. A stand-in's logs and reduces as a call of the real step does, with
        nothing of its own; under manual optimization its backward releases noise alone and its optimizer
        steps are real (the dry pass's stand-ins for them are set aside for the call)."""
        if not self._stand_in:
            return user_step(*args, **kwargs)
        self._stand_in = False  # this call only, not a training_step it calls
        names: tuple[str, ...] = ("log", "log_dict")
        if not self.module.automatic_optimization:
            names += ("manual_backward", "optimizers", "lr_schedulers")
        collectives = self.collectives
        with (
            collectives.call(PLACEHOLDER),
            collectives.placeholder_logs(self.module),
            _unshadowed(self.module, names),
        ):
            return user_step(*args, **kwargs)

    # -- placeholder passes ---------------------------------------------------------------------------------
    def agree_max(self, value: int) -> int:
        """The largest ``value`` over the ranks."""
        return self._all_reduce_max([value])[0]

    def placeholder_pass(self, grad: bool = True, batch_idx: int = 0, stand_in: bool = False) -> None:
        """A dry pass of ``training_step`` on one training example whose per-example gradients are thrown
        away: the same collectives as any pass, nothing added to the sums, the norms or the checks.
        ``stand_in``: it stands in for a call of the real step at ``batch_idx`` (see :meth:`_call`)."""
        capture = self._capture()
        hint = capture._batch_hint if capture is not None else None
        batch = self._placeholder_batch()
        state = ModuleState.save(self.module, self.device)
        stepped: _Stepped | None = None
        try:
            if capture is not None:
                capture.expect_batch(batch_length(batch))
            self._stand_in = stand_in
            with torch.set_grad_enabled(grad):
                dry_training_step(self.module, batch, batch_idx, self.precision, forward_only=not grad)
                self._after_pass()
            if stand_in and not self.module.automatic_optimization:
                stepped = _Stepped.take(self.module)
        finally:
            self._stand_in = False
            state.restore()
            if stepped is not None:
                stepped.restore()
            if capture is not None:
                capture.discard()
                capture.expect_batch(hint)
            self._forget_grads()
        self.placeholders += 1

    def _after_pass(self) -> None:
        """What ends a placeholder pass (``dp_fsdp``: its backward's collectives, then every unit resharded)."""

    def _forget_grads(self) -> None:
        """Drop what a placeholder pass left on the parameters that its state restore does not."""

    def _placeholder_batch(self) -> Any:
        if self._batch is None:
            self._batch = move_data_to_device(self.precision.convert_input(self._placeholder()), self.device)
        return self._batch

    def _all_reduce_max(self, values: list[int]) -> list[int]:
        flags = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return [int(v) for v in flags.tolist()]


@dataclass
class _Stepped:
    """What a stand-in call's real optimizer and scheduler steps leave (manual optimization), kept over the
    pass's restore: the parameter groups, the schedulers' attributes and the (released) gradients."""

    dicts: list[tuple[dict[str, Any], dict[str, Any]]]
    grads: list[tuple[Tensor, Tensor | None]]

    @classmethod
    def take(cls, module: LightningModule) -> _Stepped:
        trainer = module._trainer
        optimizers = list(getattr(trainer, "optimizers", None) or [])
        configs = list(getattr(trainer, "lr_scheduler_configs", None) or [])
        dicts = [g for o in optimizers for g in o.param_groups] + [vars(c.scheduler) for c in configs]
        return cls([(d, dict(d)) for d in dicts], [(p, p.grad) for p in module.parameters()])

    def restore(self) -> None:
        for values, items in self.dicts:
            values.clear()
            values.update(items)
        for p, grad in self.grads:
            p.grad = grad


@contextmanager
def _unshadowed(module: nn.Module, names: Sequence[str]) -> Iterator[None]:
    """The class's own methods ``names`` for the block, over what a dry pass set on the instance."""
    saved = {name: module.__dict__.pop(name) for name in names if name in module.__dict__}
    try:
        yield
    finally:
        module.__dict__.update(saved)


class Lockstep(Placeholders):
    """The passes of one fit under ``dp_fsdp`` (see the module docstring).

    Args:
        module: the LightningModule whose ``training_step`` calls are the passes.
        roots: the outermost FSDP2 modules: a backward that reached none of their outputs did not run.
        settle: called after each pass: every FSDP2 unit resharded.
        forget_grads: drops the full-size non-private gradients a dry pass left on FSDP2's parameters.
        **placeholders: :class:`Placeholders`' arguments.
    """

    def __init__(
        self,
        module: LightningModule,
        roots: Sequence[nn.Module],
        settle: Callable[[], None],
        forget_grads: Callable[[], None],
        **placeholders: Any,
    ) -> None:
        super().__init__(module, **placeholders)
        self.roots = list(roots)
        self._settle, self._forget = settle, forget_grads
        self.passes = 0
        """Passes this rank made (its own and placeholders)."""
        self._open = False
        self._grad = False
        self._outputs: list[Tensor] = []
        self._reached = False
        self._windowed = False
        self._draining = False
        self._handles: list[RemovableHandle] = []

    # -- installing ---------------------------------------------------------------------------------------
    def install(self) -> None:
        """Every ``training_step`` call (Lightning's, a check's, a placeholder's) becomes a pass."""
        if self._user_step is None:
            self._handles = [root.register_forward_hook(self._on_output) for root in self.roots]
        super().install()

    def _call(self, user_step: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.begin()
        output = super()._call(user_step, args, kwargs)
        if checking() and not _backpropagates(output):  # a dry pass no backward follows: closed now,
            self.close()  # before the check reads the parameters (the real step's waits for the ranks)
        return output

    def remove(self) -> None:
        self.close()
        super().remove()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _after_pass(self) -> None:
        self.close()

    def _forget_grads(self) -> None:
        self._forget()

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
