"""The mixing check's passes: the two dry passes on one batch and what is compared between them.

Pass A runs the user's step on the batch as the real step will receive it; pass B on the batch with the
examples (units) :mod:`~lightning_dp.checks.mixing_rows` chose removed or replaced, replaying pass A's
random draws row by row. Each pass starts from the same saved state (:class:`Saved`) and runs on one
:class:`CheckedBatch`, the batch and everything about where it is checked; the kept items' clipped sums
under each reading of the loss's normalisation are what ``checks/mixing.py`` judges.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from lightning.pytorch import LightningModule
from torch import Tensor

from lightning_dp.checks.after_step import (
    after_step_hooks,
    after_step_write_message,
    after_step_writes,
)
from lightning_dp.checks.batch_edit import map_examples, remove_rows, run_on_changed_batch, unit_id_fields
from lightning_dp.checks.mixing_rows import _Items, _Plan, choose_rows, choose_units, pick, plan
from lightning_dp.checks.mixing_tolerance import _distance, _kept_sums, _worst_norm_change, example_rounding
from lightning_dp.checks.precision_path import OpTrace, PathReference, path_message
from lightning_dp.checks.row_draws import DrawLog, RowDraws
from lightning_dp.checks.snapshot import ModuleState
from lightning_dp.checks.state import ParameterValues, parameter_write_message
from lightning_dp.checks.step_hooks import StepHookRun, differing, step_hook_write_message, step_hooks
from lightning_dp.checks.user_step import dry_training_step
from lightning_dp.clipping import clip_factors
from lightning_dp.core.batches import UnitInfo, batch_length, tensor_leaves
from lightning_dp.core.errors import DPConfigurationError

if TYPE_CHECKING:
    from lightning_dp.engine import PrivateStepEngine
    from lightning_dp.per_example import PerExampleGradients


@dataclass(frozen=True)
class CheckedBatch:
    """One batch a check runs on, and what every pass over it needs: the engine (its per-example gradients,
    C, the sampler), the module, the batch as the step receives it, its index, precision and device, and its
    privacy units (``unit``: "user" or "example"). A pass over a changed batch is :meth:`on` it."""

    engine: PrivateStepEngine
    module: LightningModule
    batch: Any
    batch_idx: int
    precision: Any
    device: torch.device
    units: UnitInfo | None = None
    unit: str = "example"

    def on(self, batch: Any, units: UnitInfo | None) -> CheckedBatch:
        """The same check on another batch (pass B's) with its own unit map."""
        return replace(self, batch=batch, units=units)

    @property
    def noun(self) -> str:
        """What one compared item is: "user" or "example"."""
        return "user" if self.units is not None and self.unit == "user" else "example"

    @property
    def grouped(self) -> str:
        """With units: what one unit's rows are, which may depend on each other."""
        return "" if self.units is None else ("rows" if self.noun == "user" else "augmented views")

    @property
    def rounding(self) -> float:
        """ρ of this precision and device (:func:`~lightning_dp.checks.mixing_tolerance.example_rounding`)."""
        return example_rounding(str(self.precision.precision), self.device)


@dataclass(frozen=True)
class Saved:
    """The module's state and parameter values before the passes: every pass starts from it, and the real
    step finds it again."""

    state: ModuleState
    values: ParameterValues

    @classmethod
    def take(cls, module: LightningModule, device: torch.device) -> Saved:
        state = ModuleState.save(module, device)
        return cls(state, ParameterValues.take(module))

    def restore(self) -> None:
        self.state.restore()
        self.values.restore()


@dataclass
class _Pass:
    samples: PerExampleGradients | None
    """Until its kept rows' sum is taken."""
    norms: Tensor
    """Certified per-example norms, fp64 [rows] on the CPU (per unit, when the batch carries units)."""
    buffers: dict[str, Tensor]
    written_parameters: list[str]
    row_norms: Tensor | None = None
    """With units: each row's certified norm (pass A only)."""
    after_step: dict[str, Tensor] = field(default_factory=dict)
    """Parameters and buffers with new values once the after-step hooks ran too (``after_step.py``)."""
    step_hooks: dict[str, Any] = field(default_factory=dict)
    """What the hooks inside the optimizer step wrote (``step_hooks.py``)."""


class _UnalignedDrawsError(Exception):
    """Pass B's random draws could not be given to each row as in pass A: it replaces units instead."""


def _unit_weights(items: _Items) -> Tensor:
    """w_u of each item (fp64, CPU): its rows' weight in its gradient (1/n_u under "mean"; 1 for a row)."""
    if items.units is None:
        return torch.ones(items.rows, dtype=torch.float64)
    weights = torch.zeros(items.count, dtype=torch.float64)
    weights[items.units.unit_of_row.cpu()] = items.units.row_weights().double().cpu()
    return weights


@dataclass
class _Reading:
    """One reading of how the loss is normalised, and the kept units' clipped sums under it.

    ``scale`` None: the loss is a mean over the batch's R rows (each row's gradient is R times its share,
    reduced per unit as configured: the engine's default under ``loss_reduction="mean"``). ``scale`` B (the
    expected batch size, ``users_per_step``): it is divided by public constants only, and a unit's gradient
    is B times its share of the gradient, its rows summed. Under it each item's gradient is ``factor`` times
    the batch reading's."""

    scale: float | None
    norms_a: Tensor
    factors: Tensor
    magnitudes: Tensor
    weights_a: Tensor
    norms_b: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))
    weights_b: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))
    move: float = 0.0

    @classmethod
    def of(cls, scale: float | None, items: _Items, full: _Pass, c: float) -> _Reading:
        magnitudes = full.norms
        if items.units is not None:
            assert full.row_norms is not None
            magnitudes = items.magnitudes(full.row_norms, full.norms)
        lam = _factor(scale, items)
        norms = lam * full.norms
        factors = clip_factors(norms.float(), c).double()
        return cls(scale, norms, factors, lam * magnitudes, factors * lam)

    def finish(self, other: _Pass, after: _Items, kept_full: list[int], kept_changed: list[int]) -> None:
        """Pass B's norms and sum weights under this reading (pass A's clip factors, pass B's own scale)."""
        lam = _factor(self.scale, after)
        self.norms_b = lam * other.norms
        self.weights_b = torch.zeros(after.count, dtype=torch.float64)
        self.weights_b[kept_changed] = self.factors[kept_full] * lam[kept_changed]


def _factor(scale: float | None, items: _Items) -> Tensor:
    """Each item's gradient under a reading, relative to the batch reading's: 1, or B / (R · w_u)."""
    if scale is None:
        return torch.ones(items.count, dtype=torch.float64)
    return scale / (items.rows * _unit_weights(items))


def _readings(engine: PrivateStepEngine, items: _Items, full: _Pass) -> dict[str, _Reading]:
    """The readings a check compares: the batch mean, and for users under ``loss_reduction="mean"`` the public
    one (at example level a loss is a mean or a sum: a sum returned as a mean stays refused, with its fix)."""
    c = engine.max_grad_norm
    out = {"batch": _Reading.of(None, items, full, c)}
    if engine.loss_reduction == "mean" and items.units is not None and engine.sampler.unit == "user":
        out["public"] = _Reading.of(float(engine.sampler.expected_batch_size), items, full, c)
    return out


@dataclass
class _Compared:
    """Both passes and what the check compares between them."""

    full: _Pass
    other: _Pass
    items: _Items
    changed: tuple[int, ...]
    kept_full: list[int]
    kept_changed: list[int]
    removed: tuple[int, ...]
    replaced: tuple[int, ...]
    readings: dict[str, _Reading]
    full_sums: dict[str, list[Tensor]]
    """Pass A's kept clipped sum under each reading."""
    log: DrawLog
    """Pass A's random draws, which every later pass replays row by row."""
    moved_draws: tuple[str, ...] = ()
    """The random functions pass B called with another law than pass A (``RowDraws.moved``)."""
    aligned: bool = True
    """Whether every random draw of pass A can be replayed row by row (:class:`RowDraws`, no other stream)."""


def _written_differently(full: _Pass, other: _Pass) -> tuple[str, ...]:
    """Refuse parameters either pass wrote; the buffers the two passes wrote differently."""
    written = sorted(set(full.written_parameters) | set(other.written_parameters))
    if written:
        raise DPConfigurationError(parameter_write_message(written, "training_step"))
    return tuple(
        name
        for name in sorted(full.buffers.keys() | other.buffers.keys())
        if name not in full.buffers
        or name not in other.buffers
        or not torch.equal(full.buffers[name], other.buffers[name])
    )


def _refuse_hook_writes(
    module: LightningModule, batch_idx: int, full: _Pass, other: _Pass, buffers: tuple[str, ...]
) -> None:
    """Refuse what the hooks inside the optimizer step, then those after it, wrote differently in the two
    passes (from the batch, or from its non-private gradient); what the forward wrote is ``buffers``."""
    stepped = [n for n in differing(full.step_hooks, other.step_hooks) if n not in buffers]
    if stepped:
        names = [hook.name for hook in step_hooks(module)]
        raise DPConfigurationError(step_hook_write_message(stepped, names))
    after = [n for n in differing(full.after_step, other.after_step) if n not in buffers]
    if after:
        hooks = [hook.name for hook in after_step_hooks(module, batch_idx)]
        raise DPConfigurationError(after_step_write_message(after, hooks))


def _other_streams_moved(state: ModuleState) -> bool:
    """Whether the pass drew from Python's or NumPy's global stream or from a generator the module holds
    (draws :class:`~lightning_dp.checks.row_draws.RowDraws` does not make row by row)."""
    saved, now = state.random_state, state.rng.state()
    numpy_same = all(np.array_equal(x, y) for x, y in zip(saved[3], now[3], strict=True))
    return saved[2] != now[2] or not numpy_same or state.python.drew_random_numbers()


def dry_pass(
    checked: CheckedBatch,
    saved: Saved,
    rows: int,
    with_row_norms: bool = False,
    draws: RowDraws | None = None,
    trace: OpTrace | None = None,
) -> _Pass | None:
    """One dry pass from the saved state: its per-example gradients and norms (per unit, grouped as the
    clipping groups them, when ``checked.units`` is given), and what it wrote; ``draws``: the random numbers
    its torch random calls draw (:class:`~lightning_dp.checks.row_draws.RowDraws`); ``trace``: its torch calls."""
    engine, module, batch, batch_idx, units = (
        checked.engine, checked.module, checked.batch, checked.batch_idx, checked.units
    )  # fmt: skip
    state, values = saved.state, saved.values
    saved.restore()
    grads = engine.grads
    assert grads is not None
    grads.clear()
    grads.expect_batch(rows)
    for p in engine.params:
        p.grad = None
    hooks = StepHookRun.of(module, state, values)  # on_after_backward & co., where Lightning runs them
    with torch.enable_grad(), draws if draws is not None else contextlib.nullcontext():
        dry = dry_training_step(module, batch, batch_idx, checked.precision, hooks=hooks, trace=trace)
    if not dry.backpropagated:
        grads.clear()
        return None
    samples, _ = grads.collect(expected=rows)
    row_norms = None
    if units is not None:
        if with_row_norms:
            row_norms = samples.sq_norms().double().sqrt().cpu()
        samples = samples.grouped(units.unit_of_row, units.reduction, units.views)
    norms = samples.sq_norms().double().sqrt().cpu()
    if hooks is not None:
        hooks.before_optimizer_step()
        assert hooks.forward is not None
        trained, frozen, buffers = hooks.forward  # what training_step wrote, before the hooks
    else:
        (trained, frozen), buffers = values.written_by_kind(), state.written_buffers()
    written = {**buffers, **frozen}  # frozen parameters: like buffers
    after = after_step_writes(module, batch, batch_idx, dry, state, values)  # on_train_batch_end
    grads.clear()  # what a hook's own forward recorded
    return _Pass(samples, norms, written, trained, row_norms, after, hooks.writes if hooks else {})


def compare(
    checked: CheckedBatch,
    saved: Saved,
    items: _Items,
    generator: torch.Generator,
    path: PathReference | None = None,
) -> _Compared | None:
    """Pass A on the batch, pass B on the batch with changed units, and the kept units' clipped sums of
    both under each reading of the loss's normalisation (:func:`_readings`). None: no loss to check.
    ``path``: pass A's torch operations are traced there."""
    engine, batch = checked.engine, checked.batch
    rows, units = items.rows, items.units
    draws = RowDraws(rows, device=checked.device)  # pass A draws what the real step will, and keeps it
    trace = path.trace if path is not None else None
    full = dry_pass(checked, saved, rows, True, draws, trace)
    if full is None:
        return None
    # Random draws (dropout) that RowDraws replays row by row still allow a removal; any other draw
    # (Python's random, NumPy, a layer's own dropout) keeps every shape: the changed units are replaced.
    other_draws = _other_streams_moved(saved.state)
    aligned = draws.aligned and not other_draws
    drew = draws.drew or other_draws
    if units is None:
        changed = choose_rows(batch, rows, full.norms, generator)
    else:
        assert full.row_norms is not None
        changed = choose_units(batch, units, full.row_norms, full.norms, generator)
    changed_set = set(changed)
    kept_full = [i for i in range(items.count) if i not in changed_set]
    readings = _readings(engine, items, full)
    full_sums = _kept_sums(full, [r.weights_a for r in readings.values()], kept_full, items.count)
    assert engine.grads is not None
    engine.grads.clear()
    how = plan(engine.sampler, batch, rows, items, changed, drew and not aligned, generator)
    moved: list[str] = []  # random functions whose law moved, in either try (removal or replacement)
    edit = _changed_pass(checked, saved, how, draws.log, kept_full, moved, generator)
    other = edit.result
    if other is None:
        return None
    after, index, removed = how.after, how.index, how.removed
    if not edit.removed:  # nothing removed (unaligned draws, or the fallback): every item in place
        after, index, removed = items, list(range(items.count)), ()
    kept_changed = [index[i] for i in kept_full]
    for reading in readings.values():
        reading.finish(other, after, kept_full, kept_changed)
    other_sums = _kept_sums(other, [r.weights_b for r in readings.values()], kept_changed, after.count)
    for reading, a, b in zip(readings.values(), full_sums, other_sums, strict=True):
        reading.move = _distance(a, b)
    replaced = tuple(i for i in changed if i not in removed)
    sums = dict(zip(readings, full_sums, strict=True))
    return _Compared(
        full, other, items, changed, kept_full, kept_changed, removed, replaced, readings, sums, draws.log,
        tuple(moved), aligned,
    )  # fmt: skip


ORDER_RTOL = 0.03
"""How much a unit's gradient norm may differ when its rows sit elsewhere in the batch: the norms compared are
certified bounds (up to 1 % above the exact norm, ``mixing_tolerance.GUARD_FRACTION``), on both sides."""


def order_moves(checked: CheckedBatch, saved: Saved, items: _Items, full: _Pass, log: DrawLog) -> bool:
    """Whether a unit's gradient changes when the batch's units sit in another order (each unit's rows kept
    together and in their order, each row with pass A's own random draws, the unit map moved with them).

    The engine groups the per-example gradients by position: row r of every layer call is taken for the r-th
    row of the batch, whose unit is known. A step that reorders the batch's rows before its layers see them
    (``x[perm]``, ``x.flip(0)``, the halves swapped; data carry no autograd history, so no layer call shows
    the permutation) has each unit clipped with other units' rows and one unit split over several, and so
    does a term pairing rows by position (``z - z.roll(1, 0)``). Such a step gives the units other gradients
    when they sit elsewhere; a step that computes each row from its own data (and its unit's) does not.

    Run only on a batch the comparison already refuses (one or two more dry passes, on refused batches
    alone): it names the cause, and refuses nothing the removal passed."""
    units = items.units
    assert units is not None
    rows = items.rows
    if items.count < 2 or any(
        t.dim() > 1 and t.shape[0] != rows and t.shape[1] == rows for t in tensor_leaves(checked.batch)
    ):
        return False  # one unit, or a time-major field the batch edits do not move: nothing to compare
    moved = _other_order(items.count)
    fields = unit_id_fields(checked.batch, rows, units.unit_of_row.tolist(), units.ids)
    # First the ids travel with their rows; where that moves a unit, they stay in their places too (the unit
    # at each place takes the id of the one that sat there): a step may rely on the batch's users coming in
    # the sampler's order of their ids (torch.unique's counts splitting the rows), which every real batch has.
    for ids_in_place in (False, True) if fields else (False,):
        norms = _reordered_norms(checked, saved, items, log, moved, fields if ids_in_place else frozenset())
        if norms is None:
            return False  # no loss, or draws that cannot follow their rows: pass B's comparison decides
        a = full.norms.double()
        b = norms[torch.argsort(moved)]  # unit u sat at place argsort(moved)[u]
        floor = 1e-6 * float(a.max()) + 1e-30
        if not bool(((a - b).abs() > ORDER_RTOL * torch.maximum(a, b) + floor).any()):
            return False
    return True


def _reordered_norms(
    checked: CheckedBatch, saved: Saved, items: _Items, log: DrawLog, moved: Tensor, id_fields: frozenset[int]
) -> Tensor | None:
    """Each unit's gradient norm (fp64, by place) with unit ``moved[i]`` at place i (its rows together, in
    their order, with pass A's draws); the fields ``id_fields`` (:func:`unit_id_fields`) left in their places,
    or every field moved when it is empty. None: no loss, or draws that cannot follow their rows."""
    units = items.units
    assert units is not None
    rows = items.rows
    counts = units.rows_per_unit().cpu()
    starts = torch.cumsum(counts, 0) - counts
    order = torch.cat([torch.arange(int(starts[u]), int(starts[u] + counts[u])) for u in moved.tolist()])
    place_of_row = torch.repeat_interleave(torch.arange(items.count), counts[moved])
    in_place = starts[place_of_row]  # the first row of the unit that sat at each row's place
    kept_ids = units.ids if id_fields or units.ids is None else tuple(units.ids[u] for u in moved.tolist())
    placed = UnitInfo(place_of_row.to(units.unit_of_row.device), units.reduction, units.views, kept_ids)
    position = iter(range(1 << 62))  # the fields in per_example_fields' order

    def pick(at: int) -> Tensor:
        return in_place if at in id_fields else order

    def tensor(t: Tensor) -> Tensor:
        return t.index_select(0, pick(next(position)).to(t.device))

    def values(v: list[Any]) -> list[Any]:
        return [v[i] for i in pick(next(position)).tolist()]

    batch = map_examples(checked.batch, rows, tensor, values)
    rerun = RowDraws(rows, log, order.tolist(), checked.device, checked.rounding)
    other = dry_pass(checked.on(batch, placed), saved, rows, False, rerun)
    if other is None or not rerun.aligned or rerun.moved:
        return None
    return other.norms.double()


def _other_order(count: int) -> Tensor:
    """A fixed other order of ``count`` units: a permutation drawn from its own seeded generator (the check's
    stream is left as it is, and a rerun names the same refusal). Not a rotation nor a reversal of the units,
    where it can avoid them: a step that rolls, flips or swaps the batch's halves commutes with those when the
    units have equal sizes, and would give each unit its gradient unchanged."""
    generator = torch.Generator().manual_seed(0x5EED + count)
    plain = torch.arange(count)
    avoided = [plain.roll(k) for k in range(count)] + [plain.flip(0).roll(k) for k in range(count)]
    for _ in range(16):
        order = torch.randperm(count, generator=generator)
        if not any(torch.equal(order, other) for other in avoided):
            return order
    return plain.roll(1)  # three units or fewer: every order is a rotation or a reversal


def step_order_message(noun: str, releases_before: int) -> str:
    """The refusal for a step whose units' gradients depend on where their rows sit in the batch."""
    return (
        f"Sensitivity check failed on step {releases_before} (a real sampled batch): with the batch's {noun}s "
        f"in another order (each {noun}'s rows kept together, with their own random draws), a {noun}'s clipped "
        "gradient changed, so the step's rows are not the batch's rows in their order. Each row's "
        f"{noun} is known by its position in the batch: a training_step that reorders the batch's rows before "
        "its layers (x[perm], x.flip(0), the batch's halves swapped, torch.cat of its parts in another order) "
        f"has each {noun} clipped with other {noun}s' rows and one {noun} split over several, and a term that "
        f"pairs rows by position (z - z.roll(1, 0), neighbouring rows) mixes {noun}s, so one {noun} can move "
        "the released sum by more than max_grad_norm and the reported ε does not hold. This step releases "
        "nothing. Keep the batch's rows in their order inside training_step (the order carries nothing the "
        f"gradient needs), and pair or mix rows only within one {noun}; to train such a step unchanged, pass "
        f"DPStrategy(checks=Checks(isolate_examples=True)): each {noun} then runs through training_step alone."
    )


def _changed_pass(
    checked: CheckedBatch,
    saved: Saved,
    how: _Plan,
    log: DrawLog,
    kept_full: list[int],
    moved: list[str],
    generator: torch.Generator,
) -> Any:
    """Pass B as ``how`` plans it, removal falling back to replacement where the step cannot run on it or
    its random draws cannot be given to each row as in pass A; the functions whose law moved go to ``moved``."""
    items = how.items
    rows = items.rows
    removed_rows = items.rows_of(how.removed)
    row_map = [i for i in range(rows) if i not in set(removed_rows)]
    rounding = checked.rounding

    def run(b: Any, n: int, kept: list[int]) -> _Pass | None:
        rerun = RowDraws(rows, log, row_map if n != rows else None, checked.device, rounding, kept)
        try:
            out = dry_pass(checked.on(b, how.units_after(n)), saved, n, False, rerun)
        finally:
            moved.extend(name for name in rerun.moved if name not in moved)
        if n != rows and not rerun.aligned:
            raise _UnalignedDrawsError  # the removal's draws differ from pass A's: replace instead
        return out

    return run_on_changed_batch(  # removal falls back to replacement where the step cannot run on it
        checked.batch, rows, tuple(removed_rows), tuple(items.rows_of(how.replaced)), items.rows_of(kept_full),
        functools.partial(pick, generator), run, saved.state.restore, how.keep_fields, how.relabel,
    )  # fmt: skip


def confirm_public(
    checked: CheckedBatch, saved: Saved, compared: _Compared, move_limit: float, change_limit: float
) -> bool:
    """Before a run takes the public reading (its loss divided by public constants, not by the batch's
    rows): the kept units must also stay in place with every changed unit removed at once. One removal
    may leave a count the loss reads unchanged (the labelled rows of a mean over the batch's labels, when
    the removed unit had none), which the batch reading shows through the rows' count and the public
    reading would not. ``move_limit``, ``change_limit``: the tolerances of the result it would show."""
    items, kept_full = compared.items, compared.kept_full
    after, index = items.without(list(compared.changed))
    gone = set(items.rows_of(compared.changed))
    row_map = [r for r in range(items.rows) if r not in gone]
    draws = RowDraws(items.rows, compared.log, row_map, checked.device, checked.rounding)
    try:
        smaller = checked.on(remove_rows(checked.batch, tuple(sorted(gone)), items.rows), after.units)
        run = dry_pass(smaller, saved, after.rows, False, draws)
    except Exception:  # the step cannot run on so small a batch: the public reading is not shown
        return False
    if run is None or not draws.aligned or draws.moved:
        return False
    reading = compared.readings["public"]
    kept = [index[i] for i in kept_full]
    lam = _factor(reading.scale, after)
    weights = torch.zeros(after.count, dtype=torch.float64)
    weights[kept] = reading.factors[kept_full] * lam[kept]
    norms = lam * run.norms
    (sums,) = _kept_sums(run, [weights], kept, after.count)
    c = checked.engine.max_grad_norm
    move = _distance(compared.full_sums["public"], sums) / (c if math.isfinite(c) and c > 0 else 1.0)
    worst, _ = _worst_norm_change(reading.norms_a[kept_full], norms[kept], c, reading.magnitudes[kept_full])
    return move <= move_limit and worst <= change_limit


def in_run_precision(checked: CheckedBatch, path: PathReference) -> None:
    """The forward of pass A again, in the run's own precision (the batch as the step gets it, pass A's
    random draws): it must make the torch operations the fp32 pass A made (``checks/precision_path.py``).
    Raises where it does not; puts everything back as the check's passes do."""
    grads = checked.engine.grads
    assert grads is not None
    module, batch = checked.module, checked.batch
    rows = batch_length(batch)
    saved = Saved.take(module, checked.device)
    hint = grads._batch_hint
    trace = OpTrace()
    try:
        grads.expect_batch(rows)
        with torch.enable_grad(), RowDraws(rows or 0, path.log, None, checked.device):
            dry = dry_training_step(
                module, batch, checked.batch_idx, checked.precision, forward_only=True, trace=trace
            )
        if (dry.loss is None and module.automatic_optimization) or not trace.same(path.trace):
            raise DPConfigurationError(path_message(path.precision))
    finally:
        saved.restore()
        grads.clear()
        grads.expect_batch(hint)
