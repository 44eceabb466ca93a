"""The mixing check: on the real sampled batches, does any example's gradient depend on another example?

DP-SGD's proof needs each example's clipped gradient to be a function of that example alone; then adding
or removing one example moves the released sum by at most C. A loss or forward that mixes examples (mixup,
a token mean over the batch, batch statistics, in-batch contrastive losses, class weights from the batch's
label counts, hard-example mining) breaks this silently.

On a checked step, before the user's step runs, the check runs the user's ``training_step`` twice as a dry
pass (``user_step``) on the very batch that step will receive (after every hook and callback ran), from
the same global random state and module state as the real step:

* pass A: the batch as it is: this is exactly what the real step computes next;
* pass B: the batch with many examples changed, chosen where a dependence hides (:func:`choose_rows`): the
  first and the last, every example holding an extreme (the minimum or maximum) of any column of any
  tensor of the batch, of pass A's per-example gradient norms, one example of each rarest value of every
  integer (label-like) column, and a random half of the others. One is removed and the others replaced
  by copies of kept examples (the batch's size and its content both move, so a dependence on either
  shows). Pass A's random draws are replayed row by row in pass B (``row_draws``), so a kept example gets
  its own dropout masks however many rows the batch has, and each draw's law (a dropout's p, a noise's
  std) must be pass A's, or the step is refused by the function's name (:meth:`MixingCheck.draw_law_refusal`):
  a replayed value would hide a law computed from the batch; where a draw cannot be replayed so (Python's
  ``random``, NumPy, a layer's built-in dropout), every changed example is replaced (same shapes, so every
  draw is the same for the others).

The criterion is the proof's own quantity, in units of C: how far the kept examples' clipped gradients
move, ‖Σ_j (ḡ_j(D) − ḡ_j(D′))‖ / C (each with its clip factor from pass A), against a tolerance set by
rounding, not by the size of the sum (:func:`move_tolerance`). A batch statistic in a denominator moves
every kept example a little and the sum by much more, at any batch size. Each kept example's gradient norm
is also compared (within 1 %), a second test, never the only one. Buffers the forward writes must be
written the same way in both passes (a running statistic or an observer of the batch is not); parameters
must not be written at all (compared by value, so ``.data`` writes and flag-guarded initialisation count).
Nothing is released, priced or stepped, and the random streams, ``.grad``, parameters and buffers are put
back, so the real step is the step without the check.

With privacy units (a user's rows under ``privacy_unit="user"``, an example's views under
``augmentation_multiplicity``) the same check works on units, not rows: each unit is clipped as one, so
its own rows may depend on each other and only a dependence between units breaks the guarantee. Pass A's
gradients are grouped as the clipping groups them (unit norms, unit clip factors); pass B changes whole
units (:func:`choose_units`: every unit holding a row :func:`choose_rows` would single out, the units'
norm extremes, a random half of the others), removing one with all its rows (its unit map
``UnitInfo.without``) and replacing the others' rows by copies of kept units' rows that keep their own
unit's id field (``batch_edit.unit_id_fields``); the criterion is the kept units' clipped sum, with a
rounding allowance over the rows the sums add (:meth:`_Items.magnitudes`). For users under a mean loss the
criterion is read two ways (:class:`_Reading`): the loss as a mean over the batch's rows (the engine's
default rescaling by the rows' count) and as divided by public constants only (a per-user loss over
``users_per_step``); the engine keeps the reading under which no kept unit moves (``engine.normalisation``).

Which steps: the first sampled batch of every fit, and then steps drawn at random while the time spent
checking stays within ``overhead`` of the training time (default 5 %); ``"every_step"`` checks every step.
A step whose ``training_step`` returns no loss moves the check to the next batch.

This module holds the check itself (the schedule, the judgment, the refusals); which rows pass B changes
is ``mixing_rows.py``, the rounding allowance ``mixing_tolerance.py``, and the two passes over one
:class:`~lightning_dp.checks.mixing_passes.CheckedBatch` ``mixing_passes.py``.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch import LightningModule

from lightning_dp.checks.batch_hooks import hook_note
from lightning_dp.checks.mixing_passes import (
    CheckedBatch,
    Saved,
    _Compared,
    _Reading,
    _refuse_hook_writes,
    _written_differently,
    compare,
    confirm_public,
    in_run_precision,
    order_moves,
    step_order_message,
)
from lightning_dp.checks.mixing_rows import _Items, draw, pick
from lightning_dp.checks.mixing_tolerance import (
    _summation_terms,
    _worst_norm_change,
    move_tolerance,
    relative_tolerance,
)
from lightning_dp.checks.pass_precision import full_precision, runs_in_full_precision, upcast_batch
from lightning_dp.checks.precision_path import PathReference, computes_in_reduced_precision
from lightning_dp.core.batches import UnitInfo, batch_length
from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.core.rng import make_generator

if TYPE_CHECKING:
    from lightning_dp.engine import PrivateStepEngine
    from lightning_dp.per_example.capture import GradientCapture

CheckSetting = bool | Literal["every_step"]

DEFAULT_OVERHEAD = 0.05

USER_LOSS_NOTE = (
    " A per-user loss may weigh each user by public constants only: the sum over the batch's users of each "
    "user's mean (or summed) loss, divided by users_per_step, trains as it is; divided by the batch's number "
    "of users or rows, or weighted by another user's row count (relative to the batch's largest user), it "
    "mixes users."
)
"""Appended to a refusal of a user-level check: how a per-user loss is normalised without mixing users."""


@dataclass(frozen=True)
class MixingResult:
    """What one check measured on one batch."""

    change: str
    """What pass B did, e.g. "examples [0, 3, 7] removed"."""
    changed: tuple[int, ...]
    """The examples (or units) removed or replaced (their indices in the batch)."""
    examples: int
    """The examples in the checked batch (its units, when its rows carry units)."""
    move: float
    """How far the clipped sum of the kept examples moved, in units of C (the proof's quantity)."""
    move_tolerance: float
    """The move rounding explains, in units of C (:func:`move_tolerance`)."""
    worst_change: float = 0.0
    """The largest relative change of a kept example's gradient norm (the per-example test)."""
    tolerance: float = 1.0
    """The per-example test's relative tolerance."""
    buffers: tuple[str, ...] = ()
    """Buffers the forward wrote differently in the two passes (computed from the batch)."""
    unit: str = "example"
    """What one compared item is: "example" or "user"."""
    grouped: str = ""
    """With units: what one unit's rows are ("rows", "augmented views"), which may depend on each other."""

    @property
    def passed(self) -> bool:
        return self.move <= self.move_tolerance and self.worst_change <= self.tolerance and not self.buffers


def _would_switch(engine: PrivateStepEngine, results: dict[str, MixingResult]) -> bool:
    """Whether this check would move a run from the batch reading to the public one."""
    public, batch = results.get("public"), results["batch"]
    return (
        public is not None
        and public.passed
        and not batch.passed
        and engine.normalisation == "batch"
        and not engine.normalisation_settled
    )


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
    precision_fallback: str = ""
    """The run's precision, once a check had to run its passes in it (the step raised in fp32)."""
    _last_cost: float = 0.0
    _generator: torch.Generator | None = None

    @property
    def enabled(self) -> bool:
        return self.setting is not False

    @property
    def generator(self) -> torch.Generator:
        if self._generator is None:
            self._generator = make_generator(self.seed, stream="checks/mixing")
        return self._generator

    def start_fit(self) -> None:
        """A new fit: its first sampled batch is checked."""
        self.due_next = self.enabled
        self.started = time.perf_counter()

    def _draw(self) -> float:
        return draw(self.generator)

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
        return pick(self.generator, count)

    def run(
        self,
        engine: PrivateStepEngine,
        module: LightningModule,
        chunks: Sequence[tuple[Any, UnitInfo | None]],
        batch_idx: int,
        precision: Any,
        device: torch.device,
        unit: str = "example",
    ) -> list[MixingResult] | None:
        """Check the batch the next release is computed from, in every physical chunk the step will run
        (``chunks``: each with its privacy units, ``unit``: "user" or "example"; whole units are then changed
        and compared, and a unit's rows may depend on each other). None when it cannot be checked
        (``training_step`` returned no loss: the check moves to the next batch). Raises on a failure."""
        begin = time.perf_counter()
        results: list[MixingResult] = []
        checked = CheckedBatch(engine, module, None, batch_idx, precision, device, None, unit)
        try:
            for batch, units in chunks:
                result = self._measure_precisely(checked.on(batch, units))
                if result is None:
                    break
                if not result.passed:
                    note = hook_note(module, batch_idx) + (USER_LOSS_NOTE if result.unit == "user" else "")
                    raise DPConfigurationError(self.refusal(result, engine.steps) + note)
                results.append(result)
        finally:
            self._last_cost = time.perf_counter() - begin  # the budget's lookahead (RunChecks adds the time)
        if len(results) < len(chunks):
            self.moved += 1
            self.due_next = True
            return None
        # one example (unit) cannot mix: if no chunk had two, the next batch is checked instead
        self.due_next = all(result.examples < 2 for result in results)
        self.checked_steps.append(engine.steps)
        return results

    def _measure_precisely(self, checked: CheckedBatch) -> MixingResult | None:
        """:meth:`_measure` with the passes in IEEE fp32 (``checks/pass_precision.py``), so that reduced
        precision does not widen what the check lets pass, and then pass A in the run's own reduced precision,
        which must compute what the fp32 one did (``checks/precision_path.py``); in the run's own precision
        where the step cannot run in fp32 (it raised there), with a warning."""
        precision = checked.precision
        if not runs_in_full_precision(precision):
            return self._measure(checked)
        path = PathReference(str(precision.precision)) if computes_in_reduced_precision(precision) else None
        try:
            with full_precision(checked.module, precision) as plugin:
                result = self._measure(
                    replace(checked, batch=upcast_batch(checked.batch), precision=plugin), path
                )
        except DPConfigurationError:
            raise
        except Exception as error:  # the user's step in fp32: checked in its own precision instead
            if not self.precision_fallback:
                warnings.warn(
                    _precision_fallback_message(str(precision.precision), error), UserWarning, stacklevel=2
                )
            self.precision_fallback = str(precision.precision)
            return self._measure(checked)
        if result is not None and result.passed and path is not None and path.log is not None:
            in_run_precision(checked, path)
        return result

    def _measure(self, checked: CheckedBatch, path: PathReference | None = None) -> MixingResult | None:
        """Both passes on one batch from one saved state, judged under the engine's reading of the loss's
        normalisation (:meth:`_judge`); the module, the random streams and the gradients are put back."""
        grads = checked.engine.grads
        assert grads is not None, "attach() first"
        rows = batch_length(checked.batch)
        if rows is None or rows < 2:  # one example (or none) cannot mix with another: this batch is fine
            return None if rows is None else _vacuous(rows)
        if checked.units is not None and checked.units.unit_of_row.numel() != rows:
            checked = replace(checked, units=None)  # not this batch's map: the rows are compared (stricter)
        items = _Items(rows, checked.units)
        if items.count < 2:  # one unit may mix its own rows: nothing to compare it with
            return _vacuous(items.count)
        saved = Saved.take(checked.module, checked.device)
        with _passes(grads, saved):
            measured = self._results(checked, saved, items, path)
        if measured is None:
            return None
        compared, results = measured
        result = self._judge(checked.engine, results)
        if not result.passed and items.units is not None and compared.aligned:
            with _passes(grads, saved):  # the refusal stands: named after its cause if the step reorders rows
                reorders = order_moves(checked, saved, items, compared.full, compared.log)
            if reorders:
                raise DPConfigurationError(step_order_message(checked.noun, checked.engine.steps))
        return result

    def _results(
        self, checked: CheckedBatch, saved: Saved, items: _Items, path: PathReference | None
    ) -> tuple[_Compared, dict[str, MixingResult]] | None:
        """Both passes and what each reading of the normalisation measured (None: no loss to check); raises on
        a random draw whose law moved and on what the hooks wrote differently."""
        compared = compare(checked, saved, items, self.generator, path)
        if compared is None:
            return None
        if compared.moved_draws:
            raise DPConfigurationError(
                self.draw_law_refusal(compared.moved_draws, checked.noun, checked.engine.steps)
            )
        if path is not None:
            path.log = compared.log  # the run's own precision replays pass A's draws
        buffers = _written_differently(compared.full, compared.other)
        _refuse_hook_writes(checked.module, checked.batch_idx, compared.full, compared.other, buffers)
        results = {
            kind: _result(checked, compared, reading, buffers) for kind, reading in compared.readings.items()
        }
        if _would_switch(checked.engine, results) and not confirm_public(
            checked, saved, compared, results["public"].move_tolerance, results["public"].tolerance
        ):
            del results["public"]  # one removal left the others' counts in place: not shown
        return compared, results

    def _judge(self, engine: PrivateStepEngine, results: dict[str, MixingResult]) -> MixingResult:
        """The result under the engine's reading of the loss's normalisation; where that reading fails and the
        other passes, before any check settled it, the engine takes the other (a per-user loss divided by the
        public users_per_step, not by the batch's rows). A reading is settled once a check tells them apart."""
        current = engine.normalisation
        passing = [kind for kind, result in results.items() if result.passed]
        if current in passing:
            if len(passing) == 1 and len(results) > 1:
                engine.settle_normalisation(True)
            return results[current]
        if passing and not engine.normalisation_settled:
            engine.use_normalisation("public" if passing[0] == "public" else "batch")
            engine.settle_normalisation(len(passing) == 1)
            return results[passing[0]]
        return results[current]

    def refusal(self, result: MixingResult, releases_before: int) -> str:
        """The refusal: what changed, why it breaks the guarantee, the likely causes and their fixes."""
        noun = result.unit
        if result.buffers:
            what = (
                f"buffers {list(result.buffers)} were written from the batch in the forward (a running "
                "statistic, an observer's min/max or a queue of the batch's examples): they mix examples "
                "across the batch and across steps, and are saved with the model without noise"
            )
        else:
            what = f"when the batch had {result.change}, " + _what_moved(result)
        rows = result.grouped
        if not rows:
            need = (
                "DP-SGD needs each example's gradient to depend on that example alone; here the loss or the "
                "forward mixes examples, so one example can move the released sum by more than max_grad_norm"
            )
            isolate = "each example then runs through training_step alone, so nothing can mix (it costs one "
            isolate += "forward per example)"
        else:
            need = (
                f"each {noun} is clipped as one unit (all its {rows} together), so its {rows} may depend on each "
                f"other, but the unit's gradient must not depend on another {noun}'s; here the loss or the "
                f"forward mixes {noun}s, so one {noun} can move the released sum by more than max_grad_norm"
            )
            isolate = f"each {noun} then runs through training_step alone with all its {rows}, so no two "
            isolate += f"{noun}s can mix (it costs one forward per {noun})"
        return (
            f"Sensitivity check failed on step {releases_before} (a real sampled batch): {what}. "
            f"{need[0].upper()}{need[1:]} and the reported ε does not hold. This step releases "
            f"nothing. {self.coverage(releases_before)} Likely causes and fixes: a token-level mean over the whole batch "
            "(cross_entropy over flattened tokens with ignore_index, or a Hugging Face model's labels= loss): "
            "return lightning_dp.per_example_token_loss(logits, labels).mean(); an operation that mixes "
            "examples (mixup or cutmix across the batch, attention or pooling over the batch dimension, an "
            f"in-batch contrastive or triplet loss): mix within one {noun} only; a batch statistic "
            "(standardising or min-max scaling by the batch's mean, std, min or max, class weights from the "
            "batch's label counts, weights relative to the batch's largest loss, top-k hard-example mining, "
            "a running mean or an observer updated from the batch): normalise each example on its own "
            "(LayerNorm, GroupNorm) with constants fixed from public data; a loss summed over the batch while "
            "loss_reduction='mean': return the mean; a mean over the batch's rows while loss_reduction='sum' "
            "(each row's gradient then divided by the batch's size): return the sum. To train such a model "
            "unchanged, pass "
            f"DPStrategy(checks=Checks(isolate_examples=True)): {isolate}. See docs/writing-a-loss.md. Only if the model "
            "is verified otherwise (the neighbour test), DPStrategy(checks=Checks(sensitivity=False)) turns the check off."
        )

    def draw_law_refusal(self, functions: tuple[str, ...], noun: str, releases_before: int) -> str:
        """The refusal for a random draw whose law (a dropout's p, a fill's mean, std or bounds) pass B gave
        other arguments than pass A: it is computed from the batch (names the functions, no statistic)."""
        return (
            f"Sensitivity check failed on step {releases_before} (a real sampled batch): "
            f"{', '.join(functions)} drew with other arguments (a dropout's p, a mean, a std, a probability, "
            f"bounds) when other {noun}s of the batch were removed or replaced, so the law of that random "
            f"draw is computed from the batch (a batch statistic, or the batch's size). Each {noun}'s random "
            f"numbers then depend on the other {noun}s, so one {noun} can move the released sum by more than "
            "max_grad_norm and the reported ε does not hold. This step releases nothing. "
            f"{self.coverage(releases_before)} Draw with constants (a fixed p, std or bound, or one set by "
            f"the step or the epoch), or from each {noun}'s own values: a standard draw scaled per row "
            "(x + torch.randn_like(x) * x.std(dim=1, keepdim=True)), or per-row tensors of parameters "
            "(torch.bernoulli(p_rows), torch.normal(mean_rows, std_rows)). To train such a model unchanged, "
            f"pass DPStrategy(checks=Checks(isolate_examples=True)): each {noun} then runs through training_step alone. "
            "Only if the model is verified otherwise (the neighbour test), DPStrategy(checks=Checks(sensitivity=False)) "
            "turns the check off."
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
        """For the privacy report: public settings and counts only (a measured move is a statistic of the
        private gradients, so it stays in the process)."""
        return {
            "setting": "every step"
            if self.setting == "every_step"
            else ("sampled" if self.setting else "off"),
            "overhead_budget": self.overhead,
            "checked_steps": len(self.checked_steps),
            "last_checked_step": self.checked_steps[-1] if self.checked_steps else None,
            "moved_for_no_loss": self.moved,
        }


@contextlib.contextmanager
def _passes(grads: GradientCapture, saved: Saved) -> Iterator[None]:
    """Dry passes at the batch's scale (each normalisation is read from them); afterwards the module, the
    random streams and the gradient capture are as they were (its batch hint and its scale)."""
    hint, public_scale = grads._batch_hint, grads.public_scale
    grads.public_scale = None
    try:
        yield
    finally:
        saved.restore()
        grads.clear()
        grads.expect_batch(hint)
        grads.public_scale = public_scale


def _precision_fallback_message(precision: str, error: BaseException) -> str:
    """The warning when a check's passes could not run in fp32 (names the exception's type only: its text
    may hold shapes of the private batch)."""
    return (
        f"lightning-dp's sensitivity check could not run your training_step in fp32 (it raised "
        f"{type(error).__name__}), so it compared its two passes in the run's own precision ({precision}), "
        "whose rounding lets a larger move of the released sum pass: a dependence between examples smaller "
        "than that rounding is not refused. Let the step run in fp32 as well (no casts to torch.bfloat16 or "
        "torch.float16 by hand; keep the tensors the forward uses as registered buffers, which follow the "
        "model's dtype), so the check is as strict as in fp32."
    )


def _vacuous(rows: int) -> MixingResult:
    return MixingResult("nothing changed", (), rows, 0.0, 1.0)


def _describe(
    removed: tuple[int, ...], replaced: tuple[int, ...], noun: str = "example", grouped: str = ""
) -> str:
    """What pass B did, in words that hold no statistic of the batch (neither how many items it changed
    nor their positions, which bound the batch's size)."""
    whole = f" (with all their {grouped})" if grouped else ""
    if removed and replaced:
        return f"one {noun}{whole} removed and some replaced by copies of others"
    if removed:
        return f"one {noun}{whole} removed"
    return f"some {noun}s{whole} replaced by copies of others"


def _what_moved(result: MixingResult) -> str:
    """Which test failed, by cause, without the measured values or the position of any example (a move in C,
    a change of a gradient norm and which row moved most are statistics of the private data; the position
    also bounds the batch's size, which the report leaves out)."""
    noun = result.unit
    moved = result.move > result.move_tolerance
    item = f"a kept {noun}'s gradient norm changed by more than {result.tolerance:.0%}"
    if moved and result.worst_change > result.tolerance:
        return f"the clipped gradients of the other {noun}s moved by more than rounding explains, and {item}"
    if moved:
        return f"the clipped gradients of the other {noun}s moved by more than rounding explains"
    return (
        f"the other {noun}s' gradients moved: a kept {noun}'s gradient norm changed by more than "
        f"{result.tolerance:.0%}"
    )


def _result(
    checked: CheckedBatch, compared: _Compared, reading: _Reading, buffers: tuple[str, ...]
) -> MixingResult:
    """What one reading of the normalisation measured: the kept units' move and their norms' change."""
    c = checked.engine.max_grad_norm
    kept_full, kept_changed = compared.kept_full, compared.kept_changed
    a, b = reading.norms_a[kept_full], reading.norms_b[kept_changed]
    magnitudes = reading.magnitudes[kept_full]
    worst, _ = _worst_norm_change(a, b, c, magnitudes)
    clipped = (reading.factors[kept_full] * magnitudes).where(torch.isfinite(a), 0.0)
    items = compared.items
    terms = _summation_terms(items, kept_full)
    return MixingResult(
        _describe(compared.removed, compared.replaced, checked.noun, checked.grouped),
        compared.changed,
        items.count,
        reading.move / (c if math.isfinite(c) and c > 0 else 1.0),
        move_tolerance(clipped, c, checked.rounding, terms),
        worst,
        relative_tolerance(str(checked.precision.precision), checked.device),
        buffers,
        checked.noun,
        checked.grouped,
    )
