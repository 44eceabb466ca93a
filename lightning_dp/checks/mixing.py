"""The mixing check: on the real sampled batches, does any example's gradient depend on another example?

DP-SGD's proof needs each example's clipped gradient to be a function of that example alone; then adding
or removing one example moves the released sum by at most C. A loss or forward that mixes examples (mixup,
a token mean over the batch, batch statistics, in-batch contrastive losses) breaks this silently.

On a checked step, before the user's step runs, the check runs the user's ``training_step`` twice as a dry
pass (``user_step``) on the very batch that step will receive (after every hook and callback ran), from
the same global random state and module state as the real step:

* pass A: the batch as it is: this is exactly what the real step computes next;
* pass B: the batch with its first, its last and one randomly chosen example changed: removed when the step
  draws no random numbers, else replaced by copies of other examples of the batch (same shapes, so every
  random draw, dropout masks included, is the same for the others).

Every other example's per-example gradient (as the engine computes it, before clipping) must be the same in
both passes: its norm, and the sum of the clipped gradients of all of them. A change beyond a dtype-scaled
tolerance refuses the step before its release. Buffers the forward writes must be written the same way in
both passes (a running statistic of the batch is not). Nothing is released, priced or stepped, and the
random streams, ``.grad`` and buffers are put back, so the real step is the step without the check.

Which steps: the first sampled batch of every fit, and then steps drawn at random while the time spent
checking stays within ``overhead`` of the training time (default 5 %); ``"every_step"`` checks every step.
A step whose ``training_step`` returns no loss moves the check to the next batch.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch import LightningModule
from torch import Tensor

from lightning_dp.batches import batch_length
from lightning_dp.checks.batch_edit import (  # the batch-editing helpers live there; re-exported here
    _different_row,  # noqa: F401
    _example_hashes,  # noqa: F401
    _rows_of,  # noqa: F401
    remove_rows,  # noqa: F401
    replace_rows,  # noqa: F401
    run_on_changed_batch,
)
from lightning_dp.checks.user_step import ModuleState, dry_training_step
from lightning_dp.clipping import clip_factors
from lightning_dp.errors import DPConfigurationError
from lightning_dp.rng import make_generator

if TYPE_CHECKING:
    from lightning_dp.engine import PrivateStepEngine
    from lightning_dp.per_example import PerExampleGradients

CheckSetting = bool | Literal["every_step"]

RELATIVE_FLOOR = 1e-2
"""The smallest relative change refused. The norms compared are the certified ones, which may exceed the
exact norm by up to ``GUARD_FRACTION`` (1 %) of its square, by an amount that depends on the kernel a batch
size selects; passes over B and B − 1 rows also round differently (GEMM blocking, ~1e-6 in fp32). The
patterns the check exists for move an example's gradient by 8 % and more (measured)."""

DEFAULT_OVERHEAD = 0.05
NEGLIGIBLE_MOVE = 1e-5
"""A change of an example's gradient below this many C is rounding, not a leak (the noise's std is σ·C)."""


def relative_tolerance(precision: str, device: torch.device) -> float:
    """The largest relative change a correct model shows between the two passes, from the compute dtype.

    16 units in the last place of the dtype the forward runs in (bf16/fp16 under mixed precision, TF32
    for fp32 matmuls and convolutions on CUDA), never below ``RELATIVE_FLOOR``.
    """
    if "bf16" in precision:
        eps = torch.finfo(torch.bfloat16).eps
    elif "16" in precision:
        eps = torch.finfo(torch.float16).eps
    elif device.type == "cuda":
        eps = 2.0**-10  # TF32 keeps a 10-bit mantissa (cuDNN convolutions use it by default)
    else:
        eps = torch.finfo(torch.float32).eps
    return max(RELATIVE_FLOOR, 16 * eps)


@dataclass(frozen=True)
class MixingResult:
    """What one check measured on one batch."""

    change: str
    """What pass B did, e.g. "example 0 removed and examples [7, 15] replaced by copies of others"."""
    changed: tuple[int, ...]
    """The examples removed or replaced (their rows in the batch)."""
    examples: int
    worst_change: float
    """The largest relative change of another example's gradient (its norm, or the clipped sum's)."""
    worst_example: int
    move: float
    """How far the clipped sum of the other examples moved, in units of C."""
    tolerance: float
    buffers: tuple[str, ...] = ()
    """Buffers the forward wrote differently in the two passes (computed from the batch)."""

    @property
    def passed(self) -> bool:
        return self.worst_change <= self.tolerance and not self.buffers


@dataclass
class _Pass:
    norms: Tensor
    """fp64 [rows] on the CPU."""
    clipped_sum: list[Tensor]
    buffers: dict[str, Tensor]
    written_parameters: list[str]


@dataclass
class MixingCheck:
    """When to check and what the checks found (the schedule is random, from its own generator)."""

    setting: CheckSetting = True
    overhead: float = DEFAULT_OVERHEAD
    seed: int | None = None
    due_next: bool = True
    """The next sampled batch is checked whatever the budget (the first batch of a fit, a moved check)."""
    checked_steps: list[int] = field(default_factory=list)
    """Release indices (0-based steps) whose batch passed a check before its release."""
    moved: int = 0
    """Checks moved to a later batch because ``training_step`` returned no loss."""
    seconds_checking: float = 0.0
    """Time spent in every check so far (added by ``RunChecks``), against ``overhead`` × the time since start
    spent outside the checks."""
    started: float | None = None
    _last_cost: float = 0.0
    _generator: torch.Generator | None = None

    @property
    def enabled(self) -> bool:
        return self.setting is not False

    def start_fit(self) -> None:
        """A new fit: its first sampled batch is checked."""
        self.due_next = self.enabled
        self.started = time.perf_counter()

    def _draw(self) -> float:
        if self._generator is None:
            self._generator = make_generator(self.seed, stream="checks/mixing")
        return float(torch.rand((), generator=self._generator))

    def due(self) -> bool:
        """Whether the batch about to be trained is checked."""
        if not self.enabled:
            return False
        if self.setting == "every_step" or self.due_next:
            return True
        if self.started is None:
            self.started = time.perf_counter()
        # Against the time training took besides the checks: a fit then takes at most (1 + overhead) times
        # what it takes with the checks off.
        training = time.perf_counter() - self.started - self.seconds_checking
        if self.seconds_checking + self._last_cost > self.overhead * training:
            return False
        return self._draw() < 0.5  # random spacing: a pattern on every other step cannot dodge it

    def pick(self, count: int) -> int:
        return min(count - 1, int(self._draw() * count))

    def rows_to_change(self, rows: int) -> tuple[int, ...]:
        """The examples pass B changes: the first, the last and one drawn at random (at least one kept).

        Mixing can flow along the rows in either direction (with the previous row, relative to the first
        row): changing both ends and a random row shows any of it in one pass."""
        if rows == 2:
            return (self.pick(2),)
        if rows == 3:
            return (0, 2)
        return tuple(sorted({0, rows - 1, 1 + self.pick(rows - 2)}))

    def run(
        self,
        engine: PrivateStepEngine,
        module: LightningModule,
        batch: Any,
        batch_idx: int,
        precision: Any,
        device: torch.device,
    ) -> MixingResult | None:
        """Check ``batch`` (the batch the next release is computed from); None when it cannot be checked
        (``training_step`` returned no loss: the check moves to the next batch). Raises on a failure."""
        begin = time.perf_counter()
        try:
            result = self._measure(engine, module, batch, batch_idx, precision, device)
        finally:
            self._last_cost = time.perf_counter() - begin  # the budget's lookahead (RunChecks adds the time)
        if result is None:
            self.moved += 1
            self.due_next = True
            return None
        self.due_next = result.examples < 2  # one example cannot mix: the next batch is checked instead
        if not result.passed:
            raise DPConfigurationError(self.refusal(result, engine.steps))
        self.checked_steps.append(engine.steps)
        return result

    def _measure(
        self,
        engine: PrivateStepEngine,
        module: LightningModule,
        batch: Any,
        batch_idx: int,
        precision: Any,
        device: torch.device,
    ) -> MixingResult | None:
        grads = engine.grads
        assert grads is not None, "attach() first"
        rows = batch_length(batch)
        if rows is None or rows < 2:  # one example (or none) cannot mix with another: this batch is fine
            return None if rows is None else _vacuous(rows)
        tolerance = relative_tolerance(str(precision.precision), device)
        state = ModuleState.save(module, device)
        hint = grads._batch_hint
        changed_rows = self.rows_to_change(rows)
        kept_full = [i for i in range(rows) if i not in changed_rows]
        try:
            full = self._pass(engine, module, batch, batch_idx, precision, rows, kept_full, state)
            if full is None:
                return None
            # Random draws (dropout): replace only, so every shape and every draw stays the same. Else remove
            # the first changed example and replace the others: the batch's size and its content both move,
            # so a dependence on either (a loss summed but called a mean, a token mean) shows.
            removed, replaced = changed_rows[:1], changed_rows[1:]
            if state.drew_random_numbers():
                removed, replaced = (), changed_rows
            state.restore()
            edit = run_on_changed_batch(  # removal falls back to replacement where the step cannot run on it
                batch,
                rows,
                removed,
                replaced,
                kept_full,
                self.pick,
                lambda b, n, kept: self._pass(engine, module, b, batch_idx, precision, n, kept, state),
                state.restore,
            )
            other, removed, replaced, kept_changed = edit.result, edit.removed, edit.replaced, edit.kept
            if other is None:
                return None
        finally:
            state.restore()
            grads.clear()
            grads.expect_batch(hint)
        written = sorted(set(full.written_parameters) | set(other.written_parameters))
        if written:
            raise DPConfigurationError(parameter_write_message(written, "training_step"))
        buffers = tuple(
            name
            for name in sorted(full.buffers.keys() | other.buffers.keys())
            if name not in full.buffers
            or name not in other.buffers
            or not torch.equal(full.buffers[name], other.buffers[name])
        )
        return _compare(
            full,
            other,
            kept_full,
            kept_changed,
            _describe(removed, replaced),
            changed_rows,
            rows,
            tolerance,
            buffers,
            engine,
        )

    def _pass(
        self,
        engine: PrivateStepEngine,
        module: LightningModule,
        batch: Any,
        batch_idx: int,
        precision: Any,
        rows: int,
        kept: list[int],
        state: ModuleState,
    ) -> _Pass | None:
        """One dry pass: its per-example norms, the clipped sum of the ``kept`` rows, and what it wrote."""
        grads = engine.grads
        assert grads is not None
        grads.clear()
        grads.expect_batch(rows)
        for p in engine.params:
            p.grad = None
        with torch.enable_grad():
            dry = dry_training_step(module, batch, batch_idx, precision)
        if not dry.backpropagated:
            grads.clear()
            return None
        samples, _ = grads.collect(expected=rows)
        norms = samples.sq_norms().double().sqrt().cpu()
        clipped = self._clipped(samples, norms, kept, engine.max_grad_norm)
        grads.clear()
        return _Pass(norms, clipped, state.written_buffers(), state.written_parameters())

    @staticmethod
    def _clipped(
        samples: PerExampleGradients, norms: Tensor, kept: list[int], max_grad_norm: float
    ) -> list[Tensor]:
        """Σ over the ``kept`` rows of the clipped per-example gradients (what they add to the release)."""
        mask = torch.zeros(norms.shape[0])
        mask[kept] = 1
        weights = clip_factors(norms.float(), max_grad_norm) * mask
        device = samples.params[0].device if samples.params else torch.device("cpu")
        return samples.weighted_sum(weights.to(device))

    def refusal(self, result: MixingResult, releases_before: int) -> str:
        """The refusal: what changed, why it breaks the guarantee, the likely causes and their fixes."""
        if result.buffers:
            what = (
                f"buffers {list(result.buffers)} were written from the batch in the forward (a running "
                "statistic or a queue of the batch's examples): they mix examples across the batch and across "
                "steps, and are saved with the model without noise"
            )
        else:
            what = (
                f"example {result.worst_example}'s per-example gradient changed by {result.worst_change:.1%} "
                f"when the batch had {result.change} (tolerance {result.tolerance:.2g}); the clipped sum of "
                f"the other examples moved by {result.move:.2f}·C"
            )
        return (
            f"Sensitivity check failed on step {releases_before} (a real sampled batch of {result.examples} "
            f"examples): {what}. DP-SGD needs each example's gradient to depend on that example alone; here "
            "the loss or the forward mixes examples, so one example can move the released sum by more than "
            "max_grad_norm and the reported ε does not hold. This step releases nothing. "
            f"{self.coverage(releases_before)} Likely causes and fixes: a token-level mean over the whole batch "
            "(cross_entropy over flattened tokens with ignore_index, or a Hugging Face model's labels= loss): "
            "return lightning_dp.per_example_token_loss(logits, labels).mean(); an operation that mixes "
            "examples (mixup or cutmix across the batch, attention or pooling over the batch dimension, an "
            "in-batch contrastive or triplet loss): mix within one example only; a batch statistic "
            "(standardising by the batch mean or std, a running mean updated from the batch): normalise each "
            "example on its own (LayerNorm, GroupNorm); a loss summed over the batch while "
            "loss_reduction='mean': return the mean. To train such a model unchanged, pass "
            "DPStrategy(isolate_examples=True): each example then runs through training_step alone, so "
            "nothing can mix (it costs one forward per example). See docs/writing-a-loss.md. Only if the model "
            "is verified otherwise (the neighbour test), DPStrategy(check_sensitivity=False) turns the check off."
        )

    def coverage(self, releases_before: int) -> str:
        """What the releases before this step are and are not covered by (for the refusal and the report)."""
        if releases_before == 0:
            return "No release was made before it."
        checked = self.checked_steps
        last = checked[-1] if checked else None
        shown = ", ".join(str(s) for s in checked[-5:])
        return (
            f"{releases_before} releases were made before it; the check passed on the batches of steps "
            f"{'…, ' if len(checked) > 5 else ''}{shown or 'none'}. Releases after step {last} were not "
            "checked and may carry the same mixing: do not publish a model from this run."
        )

    def summary(self) -> dict[str, Any]:
        return {
            "setting": "every step"
            if self.setting == "every_step"
            else ("sampled" if self.setting else "off"),
            "overhead_budget": self.overhead,
            "checked_steps": len(self.checked_steps),
            "last_checked_step": self.checked_steps[-1] if self.checked_steps else None,
            "moved_for_no_loss": self.moved,
        }


def _vacuous(rows: int) -> MixingResult:
    return MixingResult("nothing changed", (), rows, 0.0, 0, 0.0, 1.0)


def _describe(removed: tuple[int, ...], replaced: tuple[int, ...]) -> str:
    parts = [f"example {removed[0]} removed"] if removed else []
    if replaced:
        parts.append(f"examples {list(replaced)} replaced by copies of others")
    return " and ".join(parts)


def _compare(
    full: _Pass,
    other: _Pass,
    kept_full: list[int],
    kept_changed: list[int],
    kind: str,
    changed: tuple[int, ...],
    rows: int,
    tolerance: float,
    buffers: tuple[str, ...],
    engine: PrivateStepEngine,
) -> MixingResult:
    """The largest relative change of a kept example's gradient norm, and of the kept rows' clipped sum."""
    a, b = full.norms[kept_full], other.norms[kept_changed]
    worst, worst_example = 0.0, kept_full[0]
    c = engine.max_grad_norm
    floor = _change_floor(torch.maximum(a, b), c)
    for position, (x, y) in enumerate(zip(a.tolist(), b.tolist(), strict=True)):
        if not (math.isfinite(x) and math.isfinite(y)):
            change = 0.0 if math.isfinite(x) == math.isfinite(y) else math.inf
        else:
            scale = max(x, y, floor)
            change = abs(x - y) / scale if scale > 0 else 0.0
        if change > worst:
            worst, worst_example = change, kept_full[position]
    finite = torch.isfinite(a)
    factors = clip_factors(a.float(), c).double()
    scale_sq = float((factors * a).where(finite, 0.0).square().sum())
    move_sq = sum(
        float((x.double() - y.double()).square().sum())
        for x, y in zip(full.clipped_sum, other.clipped_sum, strict=True)
    )
    move = math.sqrt(move_sq)
    scale = max(math.sqrt(scale_sq), _negligible(c))
    relative = move / scale if scale > 0 else (0.0 if move == 0 else math.inf)
    if relative > worst:
        worst = relative
    in_c = move / c if math.isfinite(c) else move
    return MixingResult(kind, changed, rows, worst, worst_example, in_c, tolerance, buffers)


def _change_floor(norms: Tensor, max_grad_norm: float) -> float:
    """The smallest gradient norm a relative change is measured against.

    A near-zero gradient has no relative precision: a saturated softmax rounds p − 1 to a few ulps (or to 0
    for most rows of an overshooting model, so the batch's median can be 0), and passes over B and B − 1 rows
    round differently. A change is measured against at least a hundredth of the typical nonzero norm, and
    against at least ``NEGLIGIBLE_MOVE·C``, a movement of the released sum far below any leak.
    """
    nonzero = norms[torch.isfinite(norms) & (norms > 0)]
    typical = float(nonzero.median()) if nonzero.numel() else 0.0
    return max(1e-2 * typical, _negligible(max_grad_norm))


def _negligible(max_grad_norm: float) -> float:
    """A gradient change too small to matter: ``NEGLIGIBLE_MOVE·C`` (0 without a finite C)."""
    return NEGLIGIBLE_MOVE * max_grad_norm if math.isfinite(max_grad_norm) else 0.0


def parameter_write_message(names: list[str], where: str) -> str:
    return (
        f"The parameters {names} were written in place during {where} (not by the optimizer step): a layer "
        "that changes its own weights from the batch in forward (nn.Embedding or nn.EmbeddingBag with max_norm, "
        "which renormalises the looked-up rows) or code that assigns to a parameter there writes private data "
        "into the model without noise, and the released gradient no longer describes the update. Remove "
        "max_norm (clip the embedding's output or penalise its norm in the loss instead), and change "
        "parameters only through the optimizer."
    )
