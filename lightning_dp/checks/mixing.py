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
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch import LightningModule
from torch import Tensor

from lightning_dp.checks.after_step import (
    after_step_hooks,
    after_step_write_message,
    after_step_writes,
    differing_writes,
)
from lightning_dp.checks.batch_edit import (  # the batch-editing helpers live there; re-exported here
    _different_row,  # noqa: F401
    _example_hashes,  # noqa: F401
    _rows_of,  # noqa: F401
    id_extremes,
    id_forms,
    remove_rows,
    replace_rows,  # noqa: F401
    run_on_changed_batch,
    unit_id_fields,
)
from lightning_dp.checks.fingerprint import _columns
from lightning_dp.checks.pass_precision import (
    FullPrecision,
    full_precision,
    runs_in_full_precision,
    upcast_batch,
)
from lightning_dp.checks.row_draws import DrawLog, RowDraws
from lightning_dp.checks.state import ParameterValues, parameter_write_message
from lightning_dp.checks.user_step import ModuleState, dry_training_step, hook_note
from lightning_dp.clipping import clip_factors
from lightning_dp.core.batches import UnitInfo, batch_length
from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.core.rng import make_generator

if TYPE_CHECKING:
    from lightning_dp.engine import PrivateStepEngine
    from lightning_dp.per_example import PerExampleGradients

CheckSetting = bool | Literal["every_step"]

RELATIVE_FLOOR = 1e-2
"""The smallest relative change of one example's gradient norm refused (the per-example test). The norms
compared are the certified ones, which may exceed the exact norm by up to ``GUARD_FRACTION`` (1 %) of its
square, by an amount that depends on the kernel a batch size selects."""

DEFAULT_OVERHEAD = 0.05
NEGLIGIBLE_MOVE = 1e-5
"""A move of the released sum below this many C is rounding, not a leak (the noise's std is σ·C)."""

FP32_EXAMPLE_ROUNDING = 2.0**-13
"""How much one example's fp32 gradient may differ, relatively, between passes over different rows: GEMM
blocking and the convolution algorithm a batch size selects (Winograd and FFT ones differ by ~1e-5 to
1e-4) change the rounding, not the value."""

USER_LOSS_NOTE = (
    " A per-user loss may weigh each user by public constants only: the sum over the batch's users of each "
    "user's mean (or summed) loss, divided by users_per_step, trains as it is; divided by the batch's number "
    "of users or rows, or weighted by another user's row count (relative to the batch's largest user), it "
    "mixes users."
)
"""Appended to a refusal of a user-level check: how a per-user loss is normalised without mixing users."""

_U32 = 2.0**-24
RARE_VALUE_COLUMNS = 64
"""Integer tensors with at most this many columns per example are read as labels (rare values sought)."""
RARE_VALUES = 16
"""At most this many rarest values of one column are changed."""


def _compute_eps(precision: str, device: torch.device) -> float:
    """Machine epsilon of the dtype the forward computes in (IEEE fp32 in the check's own passes,
    :data:`~lightning_dp.checks.pass_precision.FullPrecision`)."""
    if precision == FullPrecision.precision:
        return torch.finfo(torch.float32).eps
    if "bf16" in precision:
        return torch.finfo(torch.bfloat16).eps
    if "16" in precision:
        return torch.finfo(torch.float16).eps
    if device.type == "cuda":
        return 2.0**-10  # TF32 keeps a 10-bit mantissa (cuDNN convolutions use it by default)
    return torch.finfo(torch.float32).eps


def relative_tolerance(precision: str, device: torch.device) -> float:
    """The largest relative change of one example's gradient norm a correct model shows between the two
    passes: 16 units in the last place of the compute dtype, never below ``RELATIVE_FLOOR``."""
    return max(RELATIVE_FLOOR, 16 * _compute_eps(precision, device))


def example_rounding(precision: str, device: torch.device) -> float:
    """ρ: how much one example's gradient may differ, relatively, between two passes over different rows
    when nothing mixes (:data:`FP32_EXAMPLE_ROUNDING` in fp32, 4 ulps of a reduced compute dtype: each
    entry of a reduced-precision result rounds to one of its two neighbours, rarely differently)."""
    return max(FP32_EXAMPLE_ROUNDING, 4 * _compute_eps(precision, device))


def move_tolerance(
    clipped_norms: Tensor, max_grad_norm: float, rho: float, terms: int | None = None
) -> float:
    """The largest move of the kept examples' clipped sum (in units of C) that rounding explains.

    Two parts, from the kept examples' clipped norms c_j = f_j‖g_j‖ (each ≤ C): the fp32 summation of the
    K terms, certified in any order (2·γ_K·Σ_j c_j, γ_K = K·u/(1 − K·u), Higham §3.1, for both passes);
    and each example's own recomputation over other rows, ρ·c_j, whose errors come from different inputs
    and do not align (ρ·√Σ_j c_j², where a batch dependence moves the examples together: Σ_j). Plus
    :data:`NEGLIGIBLE_MOVE`. The size of the sum itself plays no part. For units, ``clipped_norms`` are
    the clipped magnitudes f_u·Σ_{r∈u} w_r‖g_r‖ (the rows' terms as the sums add them) and ``terms`` the
    kept rows (K in γ_K).
    """
    c = max_grad_norm if math.isfinite(max_grad_norm) and max_grad_norm > 0 else 1.0
    finite = clipped_norms[torch.isfinite(clipped_norms)].double()
    k = int(finite.numel()) if terms is None else terms
    gamma = k * _U32 / max(1 - k * _U32, 0.5)
    summed = 2 * gamma * float(finite.sum())
    recomputed = rho * float(finite.square().sum().sqrt())
    return NEGLIGIBLE_MOVE + (summed + recomputed) / c


SUMMATION_SHARE = 1 / 16
"""The share of C the fp32 summation of the kept sum may add to the tolerance at most (each item ≤ C)."""


def summation_chunk(items: int) -> int:
    """How many items one fp32 partial sum of a kept sum adds at most (the partial sums are added in fp64):
    with m items per partial sum, the summation's share of :func:`move_tolerance` is 2·γ_m·Σ_j c_j ≤ 2·m·u·K·C,
    kept at most :data:`SUMMATION_SHARE`·C for K items, so at no batch size can rounding hide a move of C
    (one fp32 sum of K = 2048 items would allow 0.5·C, of 8192 items 2·C)."""
    return max(1, int(SUMMATION_SHARE / (2 * _U32 * max(items, 1))))


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


@dataclass(frozen=True)
class _Plan:
    """What pass B does: the unit it removes (or none), those it replaces, the id fields a copied row keeps
    and the ids replaced users take, and the items left after the removal."""

    removed: tuple[int, ...]
    replaced: tuple[int, ...]
    keep_fields: frozenset[int]
    relabel: dict[int, dict[int, Any]] | None
    items: _Items
    after: _Items
    index: list[int]

    def units_after(self, rows: int) -> UnitInfo | None:
        """Pass B's unit map: one unit fewer, or as in pass A (nothing removed)."""
        return self.items.units if rows == self.items.rows else self.after.units


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


def _other_streams_moved(state: ModuleState) -> bool:
    """Whether the pass drew from Python's or NumPy's global stream or from a generator the module holds
    (draws :class:`~lightning_dp.checks.row_draws.RowDraws` does not make row by row)."""
    saved, now = state.random_state, state.rng.state()
    numpy_same = all(np.array_equal(x, y) for x, y in zip(saved[3], now[3], strict=True))
    return saved[2] != now[2] or not numpy_same or state.python.drew_random_numbers()


def _batch_tensors(batch: Any, rows: int) -> list[Tensor]:
    found: list[Tensor] = []
    apply_to_collection(batch, Tensor, lambda t: found.append(t) if t.dim() and t.shape[0] == rows else None)
    return found


def _columns_of(t: Tensor, rows: int) -> Tensor:
    """[rows, columns] view of a batch-first tensor (at most 4,096 columns, at fixed positions),
    as real numbers or integers that ``argmax`` takes (``fingerprint.MAX_COLUMNS``)."""
    flat = t.detach().reshape(rows, -1)
    picked = _columns(flat.shape[1])
    if picked is not None:
        flat = flat.index_select(1, picked.to(flat.device))
    if flat.is_complex():
        flat = flat.abs()
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    if flat.is_floating_point():
        flat = flat.float().nan_to_num(0.0)
    return flat


def field_extremes(batch: Any, rows: int) -> list[int]:
    """The rows holding the minimum or the maximum of any column of any batch-first tensor (a min-max
    scaler, an observer, a max over the batch reads exactly these)."""
    found: list[int] = []
    for t in _batch_tensors(batch, rows):
        flat = _columns_of(t, rows)
        if flat.numel():
            found += torch.cat([flat.argmax(0), flat.argmin(0)]).tolist()
    return list(dict.fromkeys(found))


def rare_groups(batch: Any, rows: int) -> list[list[int]]:
    """The rows of each rarest value of every integer column (at most :data:`RARE_VALUES` values per column):
    class counts over the batch, a singleton class and oversampling a minority class read these. Columns
    whose values are all distinct (indices, ids) or all equal have no rare value."""
    found: list[list[int]] = []
    for t in _batch_tensors(batch, rows):
        if t.is_floating_point() or t.is_complex():
            continue
        flat = _columns_of(t, rows)
        if flat.shape[1] > RARE_VALUE_COLUMNS:
            continue
        for column in flat.T:
            values, inverse, counts = torch.unique(column, return_inverse=True, return_counts=True)
            if values.numel() in (1, rows):
                continue
            rarest = (counts == counts.min()).nonzero().squeeze(1)[:RARE_VALUES]
            found += [(inverse == v).nonzero().squeeze(1).tolist() for v in rarest.tolist()]
    return found


def rare_values(batch: Any, rows: int) -> list[int]:
    """One row (the first) of each rarest value of every integer column (:func:`rare_groups`)."""
    return list(dict.fromkeys(group[0] for group in rare_groups(batch, rows)))


def rare_split(
    batch: Any, rows: int, generator: torch.Generator, taken: set[int]
) -> tuple[list[int], list[int]]:
    """Rows of each rarest value to change and to keep: a singleton is changed; of two or more rows, one is
    changed (one already in ``taken``, the rows changed anyway, else one drawn at random) and another, drawn
    from the rest, is kept, so a dependence between the rows of a rare class (in-batch oversampling: SMOTE
    interpolates between minority rows) shows in a kept row whatever else the check changes."""
    change: list[int] = []
    keep: list[int] = []
    for group in rare_groups(batch, rows):
        order = [group[i] for i in torch.randperm(len(group), generator=generator).tolist()]
        free = [r for r in order if r not in taken and r not in change and r not in keep]
        if len(order) > 1 and any(r in keep for r in order):
            continue  # this class is split already (another column holds the same rows)
        if len(free) == len(order):  # none changed yet: change one of them
            change.append(free.pop(0))
        if len(order) > 1 and free:
            keep.append(free[0])
    return change, keep


def norm_extremes(norms: Tensor) -> list[int]:
    """The rows with the largest and the smallest finite gradient norm (hard-example mining, self-paced
    weights relative to the batch's largest loss read these)."""
    finite = torch.isfinite(norms)
    if not bool(finite.any()):
        return []
    return list(
        dict.fromkeys(
            [int(norms.where(finite, -math.inf).argmax()), int(norms.where(finite, math.inf).argmin())]
        )
    )


def choose_rows(batch: Any, rows: int, norms: Tensor, generator: torch.Generator) -> tuple[int, ...]:
    """The rows pass B changes: one drawn at random, the first and the last, the gradient norms' extremes,
    one row of each rarest label value (another is kept), every field's extremes, then a random half of the
    others (:func:`_choose`)."""
    special, keep = _special_rows(batch, rows, norms, generator)
    return _choose(rows, special, generator, keep)


def choose_units(
    batch: Any, units: UnitInfo, row_norms: Tensor, unit_norms: Tensor, generator: torch.Generator
) -> tuple[int, ...]:
    """The units pass B changes: every unit holding a row :func:`choose_rows` would single out (drawn at
    random, first, last, the rows' norm extremes, rarest labels, fields' extremes), the units with the
    largest and the smallest gradient norm, then a random half of the other units (:func:`_choose`), and
    the unit with the most rows (:func:`_with_largest`)."""
    rows = units.unit_of_row.numel()
    unit_of_row = units.unit_of_row.cpu().tolist()
    special_rows, keep_rows = _special_rows(batch, rows, row_norms, generator)
    special = [unit_of_row[r] for r in special_rows] + norm_extremes(unit_norms)
    keep = [u for u in dict.fromkeys(unit_of_row[r] for r in keep_rows) if u not in set(special)]
    changed = _choose(units.num_units, special, generator, keep)
    return _with_largest(changed, units, set(special), generator)


def _with_largest(
    changed: tuple[int, ...], units: UnitInfo, special: set[int], generator: torch.Generator
) -> tuple[int, ...]:
    """``changed`` with the unit holding the most rows in it, when it is the only one that large: it takes
    the place of a changed unit that is not special (as many units stay kept), so that removing it (a
    weight relative to the batch's largest user) is possible on every check."""
    sizes = units.rows_per_unit().cpu()
    largest = int(sizes.argmax())
    if largest in changed or int((sizes == sizes[largest]).sum()) > 1:
        return changed
    swappable = [u for u in changed if u not in special]
    if not swappable:
        return changed
    out = swappable[int(torch.randint(len(swappable), (), generator=generator))]
    return tuple(sorted({*changed, largest} - {out}))


def _special_rows(
    batch: Any, rows: int, norms: Tensor, generator: torch.Generator
) -> tuple[list[int], list[int]]:
    """The rows where a dependence hides, to change: one drawn at random, the first and the last, the gradient
    norms' extremes, every field's extremes and one row of each rarest label value; and the rows to keep, one
    more of each rarest value (:func:`rare_split`)."""
    special = [
        int(torch.randint(rows, (), generator=generator)),
        0,
        rows - 1,
        *norm_extremes(norms),
        *field_extremes(batch, rows),
    ]
    rare, keep = rare_split(batch, rows, generator, set(special))
    return special + rare, keep


def _choose(
    count: int, special: list[int], generator: torch.Generator, keep: list[int] | tuple[int, ...] = ()
) -> tuple[int, ...]:
    """Which of ``count`` items (rows, or units) pass B changes: the ``special`` ones, then a random half of
    the others; the ``keep`` ones (a rare class's second row) are kept. A special item is changed on every
    check, any other with probability at least 1/2. About half the items are kept (at least one): where the
    special ones and half the others do not fit (a small batch with many columns), the first, the last and
    all but a random quarter of the others are changed (the ``keep`` ones kept first). The number kept is
    coprime with ``count`` (a few more items are changed, or kept in a small batch, until it is): then no
    share of the batch (of labelled rows, of a class) is the same in both passes, since n'/K = n/B has no
    solution with 0 < n < B."""
    keep_at_least = max(1, count // 4)
    limit = count - keep_at_least
    chosen = list(dict.fromkeys(special))
    taken = set(chosen)
    keep = [i for i in dict.fromkeys(keep) if i not in taken]
    held = set(keep)
    rest = [i for i in range(count) if i not in taken and i not in held]
    half = (len(rest) + len(keep) + 1) // 2
    if len(chosen) + half > limit:  # a small batch, mostly extremes: all but a random quarter of it
        size = next(k for k in range(keep_at_least, count) if math.gcd(k, count) == 1)
        inner = count > 3  # keep neither the first nor the last (mixing along the rows) unless too few
        drawn = torch.randperm(count - 2 if inner else count, generator=generator)
        candidates = [i for i in keep if not inner or 0 < i < count - 1]
        candidates += [i for i in (drawn + 1 if inner else drawn).tolist() if i not in set(candidates)]
        kept = candidates[:size]
    else:
        order = [rest[i] for i in torch.randperm(len(rest), generator=generator).tolist()]
        most = len(keep) + max(len(rest) - half, 0)
        size = next(k for k in range(max(most, 1), 0, -1) if math.gcd(k, count) == 1)
        kept = (keep + order)[:size]
    taken = set(kept)
    return tuple(i for i in range(count) if i not in taken)


@dataclass(frozen=True)
class _Items:
    """What pass B changes and the criterion compares: the batch's rows (each its own unit), or its
    privacy units (a user's rows, an example's augmented views), each clipped as one, whose rows may
    depend on each other."""

    rows: int
    units: UnitInfo | None = None

    @property
    def count(self) -> int:
        return self.rows if self.units is None else self.units.num_units

    def rows_of(self, items: list[int] | tuple[int, ...]) -> list[int]:
        """The rows of ``items``, in order."""
        if self.units is None:
            return sorted(items)
        chosen = torch.zeros(self.count, dtype=torch.bool)
        chosen[torch.as_tensor(list(items), dtype=torch.long)] = True
        return chosen[self.units.unit_of_row.cpu()].nonzero().squeeze(1).tolist()

    def without(self, removed: list[int]) -> tuple[_Items, list[int]]:
        """The items left when ``removed`` go (renumbered from 0), and each item's new index (-1: removed)."""
        if not removed:
            return self, list(range(self.count))
        gone = set(removed)
        if self.units is None:
            left = [i for i in range(self.count) if i not in gone]
            rest = _Items(self.rows - len(removed))
        else:
            rows_gone, unit_map, left_ids = self.units.without(removed)
            left = left_ids.tolist()
            rest = _Items(self.rows - len(rows_gone), unit_map)
        index = [-1] * self.count
        for new, old in enumerate(left):
            index[old] = new
        return rest, index

    def magnitudes(self, row_norms: Tensor, item_norms: Tensor) -> Tensor:
        """Each item's gradient magnitude as the fp32 sums add it up (fp64, CPU): the norm of an example;
        Σ_{r∈u} w_r‖g_r‖ for a unit, never below its norm, far above it where its rows cancel."""
        if self.units is None:
            return item_norms
        weights = self.units.row_weights().double().cpu()
        terms = (row_norms * weights).where(torch.isfinite(row_norms), 0.0)
        sums = torch.zeros(self.count, dtype=torch.float64).index_add_(0, self.units.unit_of_row.cpu(), terms)
        return torch.maximum(sums, item_norms.where(torch.isfinite(item_norms), 0.0))


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
        return float(torch.rand((), generator=self.generator))

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
        try:
            for batch, units in chunks:
                result = self._measure_precisely(
                    engine, module, batch, batch_idx, precision, device, units, unit
                )
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

    def _measure_precisely(
        self,
        engine: PrivateStepEngine,
        module: LightningModule,
        batch: Any,
        batch_idx: int,
        precision: Any,
        device: torch.device,
        units: UnitInfo | None = None,
        unit: str = "example",
    ) -> MixingResult | None:
        """:meth:`_measure` with the passes in IEEE fp32 (``checks/pass_precision.py``), so that reduced
        precision does not widen what the check lets pass; in the run's own precision where the step cannot
        run in fp32 (it raised there), with a warning."""
        if not runs_in_full_precision(precision):
            return self._measure(engine, module, batch, batch_idx, precision, device, units, unit)
        try:
            with full_precision(module, precision) as plugin:
                return self._measure(
                    engine, module, upcast_batch(batch), batch_idx, plugin, device, units, unit
                )
        except DPConfigurationError:
            raise
        except Exception as error:  # the user's step in fp32: checked in its own precision instead
            if not self.precision_fallback:
                warnings.warn(
                    _precision_fallback_message(str(precision.precision), error), UserWarning, stacklevel=2
                )
            self.precision_fallback = str(precision.precision)
        return self._measure(engine, module, batch, batch_idx, precision, device, units, unit)

    def _measure(
        self,
        engine: PrivateStepEngine,
        module: LightningModule,
        batch: Any,
        batch_idx: int,
        precision: Any,
        device: torch.device,
        units: UnitInfo | None = None,
        unit: str = "example",
    ) -> MixingResult | None:
        grads = engine.grads
        assert grads is not None, "attach() first"
        rows = batch_length(batch)
        if rows is None or rows < 2:  # one example (or none) cannot mix with another: this batch is fine
            return None if rows is None else _vacuous(rows)
        if units is not None and units.unit_of_row.numel() != rows:
            units = None  # not this batch's map: the rows are compared (stricter); the engine refuses it
        items = _Items(rows, units)
        if items.count < 2:  # one unit may mix its own rows: nothing to compare it with
            return _vacuous(items.count)
        state = ModuleState.save(module, device)
        values = ParameterValues.take(module)
        hint, public_scale = grads._batch_hint, grads.public_scale
        grads.public_scale = None  # both passes at the batch's scale: each normalisation is read from them
        noun = "user" if units is not None and unit == "user" else "example"
        grouped = "" if units is None else ("rows" if noun == "user" else "augmented views")
        try:
            compared = self._compare(
                engine, module, batch, batch_idx, precision, device, items, state, values
            )
            if compared is None:
                return None
            if compared.moved_draws:
                raise DPConfigurationError(self.draw_law_refusal(compared.moved_draws, noun, engine.steps))
            buffers = _written_differently(compared.full, compared.other)
            after = [
                n
                for n in differing_writes(compared.full.after_step, compared.other.after_step)
                if n not in buffers
            ]
            if after:  # the after-step hooks wrote from the batch (what the forward wrote is `buffers`)
                hooks = [hook.name for hook in after_step_hooks(module, batch_idx)]
                raise DPConfigurationError(after_step_write_message(after, hooks))
            results = {
                kind: self._result(
                    compared, reading, engine.max_grad_norm, precision, device, buffers, noun, grouped
                )
                for kind, reading in compared.readings.items()
            }
            if _would_switch(engine, results) and not self._confirm_public(
                engine,
                module,
                batch,
                batch_idx,
                precision,
                device,
                compared,
                state,
                values,
                results["public"],
            ):
                del results["public"]  # one removal left the others' counts in place: not shown
        finally:
            state.restore()
            values.restore()
            grads.clear()
            grads.expect_batch(hint)
            grads.public_scale = public_scale
        return self._judge(engine, results)

    def _confirm_public(
        self,
        engine: PrivateStepEngine,
        module: LightningModule,
        batch: Any,
        batch_idx: int,
        precision: Any,
        device: torch.device,
        compared: _Compared,
        state: ModuleState,
        values: ParameterValues,
        shown: MixingResult,
    ) -> bool:
        """Before a run takes the public reading (its loss divided by public constants, not by the batch's
        rows): the kept units must also stay in place with every changed unit removed at once. One removal
        may leave a count the loss reads unchanged (the labelled rows of a mean over the batch's labels, when
        the removed unit had none), which the batch reading shows through the rows' count and the public
        reading would not."""
        items, kept_full = compared.items, compared.kept_full
        after, index = items.without(list(compared.changed))
        gone = set(items.rows_of(compared.changed))
        row_map = [r for r in range(items.rows) if r not in gone]
        rounding = example_rounding(str(precision.precision), device)
        draws = RowDraws(items.rows, compared.log, row_map, device, rounding)
        try:
            run = self._pass(
                engine, module, remove_rows(batch, tuple(sorted(gone)), items.rows), batch_idx, precision,
                after.rows, state, values, after.units, False, draws,
            )  # fmt: skip
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
        c = engine.max_grad_norm
        move = _distance(compared.full_sums["public"], sums) / (c if math.isfinite(c) and c > 0 else 1.0)
        worst, _ = _worst_norm_change(
            reading.norms_a[kept_full], norms[kept], c, reading.magnitudes[kept_full]
        )
        return move <= shown.move_tolerance and worst <= shown.tolerance

    def _compare(
        self,
        engine: PrivateStepEngine,
        module: LightningModule,
        batch: Any,
        batch_idx: int,
        precision: Any,
        device: torch.device,
        items: _Items,
        state: ModuleState,
        values: ParameterValues,
    ) -> _Compared | None:
        """Pass A on the batch, pass B on the batch with changed units, and the kept units' clipped sums of
        both under each reading of the loss's normalisation (:func:`_readings`). None: no loss to check."""
        rows, units = items.rows, items.units
        draws = RowDraws(rows, device=device)  # pass A draws what the real step will, and keeps it
        full = self._pass(
            engine, module, batch, batch_idx, precision, rows, state, values, units, True, draws
        )
        if full is None:
            return None
        # Random draws (dropout) that RowDraws replays row by row still allow a removal; any other draw
        # (Python's random, NumPy, a layer's own dropout) keeps every shape: the changed units are replaced.
        other_draws = _other_streams_moved(state)
        aligned = draws.aligned and not other_draws
        drew = draws.drew or other_draws
        if units is None:
            changed = choose_rows(batch, rows, full.norms, self.generator)
        else:
            assert full.row_norms is not None
            changed = choose_units(batch, units, full.row_norms, full.norms, self.generator)
        changed_set = set(changed)
        kept_full = [i for i in range(items.count) if i not in changed_set]
        readings = _readings(engine, items, full)
        full_sums = _kept_sums(full, [r.weights_a for r in readings.values()], kept_full, items.count)
        assert engine.grads is not None
        engine.grads.clear()
        plan = self._plan(engine, batch, rows, items, changed, replace_all=drew and not aligned)
        removed_rows = items.rows_of(plan.removed)
        row_map = [i for i in range(rows) if i not in set(removed_rows)]

        moved: list[str] = []  # random functions whose law moved, in either try (removal or replacement)
        rounding = example_rounding(str(precision.precision), device)

        def run(b: Any, n: int, kept: list[int]) -> _Pass | None:
            rerun = RowDraws(rows, draws.log, row_map if n != rows else None, device, rounding, kept)
            try:
                out = self._pass(
                    engine, module, b, batch_idx, precision, n, state, values, plan.units_after(n), False, rerun
                )  # fmt: skip
            finally:
                moved.extend(name for name in rerun.moved if name not in moved)
            if n != rows and not rerun.aligned:
                raise _UnalignedDrawsError  # the removal's draws differ from pass A's: replace instead
            return out

        edit = run_on_changed_batch(  # removal falls back to replacement where the step cannot run on it
            batch, rows, tuple(removed_rows), tuple(items.rows_of(plan.replaced)), items.rows_of(kept_full),
            self.pick, run, state.restore, plan.keep_fields, plan.relabel,
        )  # fmt: skip
        other = edit.result
        if other is None:
            return None
        after, index, removed = plan.after, plan.index, plan.removed
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
            tuple(moved),
        )  # fmt: skip

    def _plan(
        self,
        engine: PrivateStepEngine,
        batch: Any,
        rows: int,
        items: _Items,
        changed: tuple[int, ...],
        replace_all: bool,
    ) -> _Plan:
        """Which changed unit pass B removes (none when ``replace_all``) and which it replaces, the id fields a
        copied row keeps and the ids replaced users take, and pass B's unit map."""
        units = items.units
        unit_of_row = None if units is None else units.unit_of_row.cpu().tolist()
        keep_fields: frozenset[int] = frozenset()
        if units is not None and unit_of_row is not None:
            keep_fields = unit_id_fields(batch, rows, unit_of_row, units.ids)
        relabel = (
            self._other_users(engine, batch, rows, units, changed, keep_fields)
            if units is not None and keep_fields
            else None
        )
        out = self._removed_item(batch, rows, changed, unit_of_row, keep_fields, items)
        removed: tuple[int, ...] = () if replace_all else (out,)
        after, index = items.without(list(removed))
        return _Plan(
            removed, tuple(i for i in changed if i not in removed), keep_fields, relabel, items, after, index
        )

    def _result(
        self,
        compared: _Compared,
        reading: _Reading,
        c: float,
        precision: Any,
        device: torch.device,
        buffers: tuple[str, ...],
        noun: str,
        grouped: str,
    ) -> MixingResult:
        """What one reading of the normalisation measured: the kept units' move and their norms' change."""
        kept_full, kept_changed = compared.kept_full, compared.kept_changed
        a, b = reading.norms_a[kept_full], reading.norms_b[kept_changed]
        magnitudes = reading.magnitudes[kept_full]
        worst, _ = _worst_norm_change(a, b, c, magnitudes)
        clipped = (reading.factors[kept_full] * magnitudes).where(torch.isfinite(a), 0.0)
        rho = example_rounding(str(precision.precision), device)
        items = compared.items
        terms = _summation_terms(items, kept_full)
        return MixingResult(
            _describe(compared.removed, compared.replaced, noun, grouped),
            compared.changed,
            items.count,
            reading.move / (c if math.isfinite(c) and c > 0 else 1.0),
            move_tolerance(clipped, c, rho, terms),
            worst,
            relative_tolerance(str(precision.precision), device),
            buffers,
            noun,
            grouped,
        )

    def _judge(self, engine: PrivateStepEngine, results: dict[str, MixingResult]) -> MixingResult:
        """The result under the engine's reading of the loss's normalisation; where that reading fails and the
        other passes, before any check settled it, the engine takes the other (a per-user loss divided by the
        public users_per_step, not by the batch's rows). A reading is settled once a check tells them apart."""
        current = engine.normalisation
        passing = [kind for kind, result in results.items() if result.passed]
        if current in passing:
            if len(passing) == 1 and len(results) > 1:
                engine.normalisation_settled = True
            return results[current]
        if passing and not engine.normalisation_settled:
            engine.use_normalisation("public" if passing[0] == "public" else "batch")
            engine.normalisation_settled = len(passing) == 1
            return results[passing[0]]
        return results[current]

    def _other_users(
        self,
        engine: PrivateStepEngine,
        batch: Any,
        rows: int,
        units: UnitInfo,
        changed: tuple[int, ...],
        fields: frozenset[int],
    ) -> dict[int, dict[int, Any]] | None:
        """New ids for the changed users' id fields: each replaced user becomes a user of the training set
        not in this batch (its id in the form the field holds: the user's own id or its index), so the batch's
        set of ids moves as between neighbours (a dependence on other users' ids shows even when every changed
        user is replaced), and a loss that groups rows by the id still sees the kept users' groups unchanged.
        Where fewer users are left out of the batch than were changed, a random share of the changed users
        gets new ids and the others keep theirs; None where the sampler keeps no ids or none is left out."""
        users = getattr(engine.sampler, "users", None)
        raw = getattr(users, "raw_ids", None)
        if units.ids is None or raw is None:
            return None
        present = {int(unit_ids[1]) for unit_ids in units.ids}
        changing = set(changed)
        kept = [int(units.ids[u][1]) for u in range(units.num_units) if u not in changing]
        wanted = min(len(changed), len(raw) - len(present))  # a high rate leaves few users out
        if wanted <= 0 or not kept:
            return None
        # Inside the kept users' range first: the kept users then hold the batch's extreme ids (the newest
        # user, the oldest), so a dependence on which user is an extreme moves a kept user.
        spare = self._left_out(present, min(kept) + 1, max(kept), wanted)
        spare += self._left_out(present, 0, len(raw), wanted - len(spare))
        unit_of_row = units.unit_of_row.cpu().tolist()
        extremes = [unit_of_row[r] for r in id_extremes(batch, rows, fields)]  # renamed first: the newest
        order = [changed[i] for i in torch.randperm(len(changed), generator=self.generator).tolist()]
        order = list(dict.fromkeys([u for u in extremes if u in changing] + order))  # user, the oldest
        new_user = dict(zip(order, spare, strict=False))  # the others keep their own ids
        out: dict[int, dict[int, Any]] = {}
        for position, form in id_forms(batch, rows, unit_of_row, units.ids, fields).items():
            out[position] = {
                r: (raw[new_user[u]] if form == 0 else new_user[u])
                for r, u in enumerate(unit_of_row)
                if u in new_user
            }
        return out

    def _left_out(self, present: set[int], low: int, high: int, count: int) -> list[int]:
        """Up to ``count`` distinct users in [low, high) not in ``present`` (added to it), drawn at random:
        by rejection where at least half the range is left out (O(count)), else from the range listed."""
        width = max(high - low, 0)
        inside = sum(1 for u in present if low <= u < high) if width else 0
        take = min(count, width - inside)
        if take <= 0:
            return []
        if 2 * inside > width:
            left = [u for u in range(low, high) if u not in present]
            chosen = [left[i] for i in torch.randperm(len(left), generator=self.generator)[:take].tolist()]
        else:
            chosen = []
            while len(chosen) < take:
                for u in torch.randint(low, high, (2 * take,), generator=self.generator).tolist():
                    if u not in present and len(chosen) < take:
                        present.add(u)
                        chosen.append(u)
        present.update(chosen)
        return chosen

    def _removed_item(
        self,
        batch: Any,
        rows: int,
        changed: tuple[int, ...],
        unit_of_row: list[int] | None,
        keep_fields: frozenset[int],
        items: _Items | None = None,
    ) -> int:
        """The one changed example (unit) pass B removes, drawn at random. Where the changed units differ in
        size, half the time the largest (3/4) or the smallest (a weight relative to the batch's largest user
        moves the others only when that user goes); else, half the time with users, one holding an id field's
        extreme: a replaced user that keeps its own id (a field in another form than ``user_key``'s, or no
        user left out of the batch to take the id of) shows a dependence on its id only when removed."""
        units = None if items is None else items.units
        if units is not None:
            sizes = units.rows_per_unit().tolist()
            if len({sizes[u] for u in changed}) > 1 and self._draw() < 0.5:
                by_size = sorted(changed, key=lambda u: sizes[u])
                return by_size[-1] if self._draw() < 0.75 else by_size[0]
        if unit_of_row is not None and keep_fields and self._draw() < 0.5:
            extremes = [unit_of_row[r] for r in id_extremes(batch, rows, keep_fields)]
            changing = set(changed)
            candidates = [u for u in dict.fromkeys(extremes) if u in changing]
            if candidates:
                return candidates[self.pick(len(candidates))]
        return changed[self.pick(len(changed))]

    def _pass(
        self,
        engine: PrivateStepEngine,
        module: LightningModule,
        batch: Any,
        batch_idx: int,
        precision: Any,
        rows: int,
        state: ModuleState,
        values: ParameterValues,
        units: UnitInfo | None = None,
        with_row_norms: bool = False,
        draws: RowDraws | None = None,
    ) -> _Pass | None:
        """One dry pass from the saved state: its per-example gradients and norms (per unit, grouped as the
        clipping groups them, when ``units`` is given), and what it wrote; ``draws``: the random numbers its
        torch random calls draw (:class:`~lightning_dp.checks.row_draws.RowDraws`)."""
        state.restore()
        values.restore()
        grads = engine.grads
        assert grads is not None
        grads.clear()
        grads.expect_batch(rows)
        for p in engine.params:
            p.grad = None
        with torch.enable_grad(), draws if draws is not None else contextlib.nullcontext():
            dry = dry_training_step(module, batch, batch_idx, precision)
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
        trained, frozen = values.written_by_kind()
        written = {**state.written_buffers(), **frozen}  # frozen parameters: like buffers
        after = after_step_writes(module, batch, batch_idx, dry, state, values)  # on_train_batch_end
        grads.clear()  # what a hook's own forward recorded
        return _Pass(samples, norms, written, trained, row_norms, after)

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
            "loss_reduction='mean': return the mean. To train such a model unchanged, pass "
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


def _kept_sums(run: _Pass, weights: list[Tensor], kept: list[int], count: int) -> list[list[Tensor]]:
    """For each weight vector (per item, as the readings give them), Σ over the ``kept`` rows (units) of the
    pass's per-example (per-unit) gradients times it, in fp64 on the CPU: fp32 partial sums of at most
    :func:`summation_chunk` items, added in fp64; the pass's gradients are let go."""
    samples, run.samples = run.samples, None
    assert samples is not None
    device = samples.params[0].device if samples.params else torch.device("cpu")
    chunk = summation_chunk(len(kept))
    masks = []
    for start in range(0, max(len(kept), 1), chunk):
        mask = torch.zeros(count, dtype=torch.float64)
        mask[kept[start : start + chunk]] = 1
        masks.append(mask)
    totals: list[list[Tensor]] = []
    for w in weights:
        parts = [
            [s.double().cpu() for s in samples.weighted_sum((w[:count] * mask).float().to(device))]
            for mask in masks
        ]
        totals.append([sum(terms[1:], terms[0]) for terms in zip(*parts, strict=True)])
    return totals


def _summation_terms(items: _Items, kept: list[int]) -> int:
    """The most terms one fp32 partial sum of :func:`_kept_sums` adds (γ's n in :func:`move_tolerance`): the
    kept rows, at most :func:`summation_chunk` of them; with units, a chunk of units, each a sum of its rows."""
    chunk = summation_chunk(len(kept))
    if items.units is None:
        return max(1, min(len(kept), chunk))
    rows = len(items.rows_of(kept))
    counts = torch.bincount(items.units.unit_of_row.cpu(), minlength=items.count)[kept] if kept else None
    largest = int(counts.max()) if counts is not None and counts.numel() else 1
    return max(1, min(rows, chunk + largest))


def _distance(a: list[Tensor], b: list[Tensor]) -> float:
    """‖a − b‖ over all tensors (fp64); equal non-finite entries (the same ±inf, NaN and NaN) count as 0."""
    total = 0.0
    for x, y in zip(a, b, strict=True):
        finite = torch.isfinite(x) & torch.isfinite(y)
        same = (x == y) | (x.isnan() & y.isnan())
        if not bool((finite | same).all()):
            return math.inf
        total += float((x - y).where(finite, 0.0).square().sum())
    return math.sqrt(total)


def _worst_norm_change(
    a: Tensor, b: Tensor, max_grad_norm: float, magnitudes: Tensor | None = None
) -> tuple[float, int]:
    """The largest relative change between the norms ``a`` and ``b`` (and its position), each measured
    against at least :func:`_change_floor`, and against a unit's magnitude (Σ_r w_r‖g_r‖, ``magnitudes``)
    when given: rows of one unit that cancel leave a small norm with the rounding of the large rows."""
    floor = _change_floor(torch.maximum(a, b), max_grad_norm)
    sizes = [0.0] * len(a) if magnitudes is None else magnitudes.nan_to_num(0.0, 0.0, 0.0).tolist()
    worst, position = 0.0, 0
    for i, (x, y, size) in enumerate(zip(a.tolist(), b.tolist(), sizes, strict=True)):
        if not (math.isfinite(x) and math.isfinite(y)):
            change = 0.0 if math.isfinite(x) == math.isfinite(y) else math.inf
        else:
            scale = max(x, y, floor, size)
            change = abs(x - y) / scale if scale > 0 else 0.0
        if change > worst:
            worst, position = change, i
    return worst, position


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
