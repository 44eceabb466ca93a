"""The mixing check's row selection: which examples (or privacy units) pass B removes or replaces.

A dependence between examples hides where a batch statistic reads: the first and the last row, the
extremes of every field and of the gradient norms, the rarest label values; the check changes those on
every check and a random half of the others (:func:`choose_rows`, :func:`choose_units`), removes one of
them and replaces the rest by copies of kept ones (:func:`plan`), giving replaced users ids of users left
out of the batch (:func:`_other_users`). Every draw comes from the check's own generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor

from lightning_dp.checks.batch_edit import id_extremes, id_forms, unit_id_fields
from lightning_dp.checks.fingerprint import _columns
from lightning_dp.core.batches import UnitInfo

RARE_VALUE_COLUMNS = 64
"""Integer tensors with at most this many columns per example are read as labels (rare values sought)."""
RARE_VALUES = 16
"""At most this many rarest values of one column are changed."""


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


def plan(
    sampler: Any,
    batch: Any,
    rows: int,
    items: _Items,
    changed: tuple[int, ...],
    replace_all: bool,
    generator: torch.Generator,
) -> _Plan:
    """Which changed unit pass B removes (none when ``replace_all``) and which it replaces, the id fields a
    copied row keeps and the ids replaced users take, and pass B's unit map."""
    units = items.units
    unit_of_row = None if units is None else units.unit_of_row.cpu().tolist()
    keep_fields: frozenset[int] = frozenset()
    if units is not None and unit_of_row is not None:
        keep_fields = unit_id_fields(batch, rows, unit_of_row, units.ids)
    relabel = (
        _other_users(sampler, batch, rows, units, changed, keep_fields, generator)
        if units is not None and keep_fields
        else None
    )
    out = _removed_item(batch, rows, changed, unit_of_row, keep_fields, items, generator)
    removed: tuple[int, ...] = () if replace_all else (out,)
    after, index = items.without(list(removed))
    return _Plan(
        removed, tuple(i for i in changed if i not in removed), keep_fields, relabel, items, after, index
    )


def _other_users(
    sampler: Any,
    batch: Any,
    rows: int,
    units: UnitInfo,
    changed: tuple[int, ...],
    fields: frozenset[int],
    generator: torch.Generator,
) -> dict[int, dict[int, Any]] | None:
    """New ids for the changed users' id fields: each replaced user becomes a user of the training set
    not in this batch (its id in the form the field holds: the user's own id or its index), so the batch's
    set of ids moves as between neighbours (a dependence on other users' ids shows even when every changed
    user is replaced), and a loss that groups rows by the id still sees the kept users' groups unchanged.
    Where fewer users are left out of the batch than were changed, a random share of the changed users
    gets new ids and the others keep theirs; None where the sampler keeps no ids or none is left out."""
    users = getattr(sampler, "users", None)
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
    spare = _left_out(present, min(kept) + 1, max(kept), wanted, generator)
    spare += _left_out(present, 0, len(raw), wanted - len(spare), generator)
    unit_of_row = units.unit_of_row.cpu().tolist()
    extremes = [unit_of_row[r] for r in id_extremes(batch, rows, fields)]  # renamed first: the newest
    order = [changed[i] for i in torch.randperm(len(changed), generator=generator).tolist()]
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


def _left_out(present: set[int], low: int, high: int, count: int, generator: torch.Generator) -> list[int]:
    """Up to ``count`` distinct users in [low, high) not in ``present`` (added to it), drawn at random:
    by rejection where at least half the range is left out (O(count)), else from the range listed."""
    width = max(high - low, 0)
    inside = sum(1 for u in present if low <= u < high) if width else 0
    take = min(count, width - inside)
    if take <= 0:
        return []
    if 2 * inside > width:
        left = [u for u in range(low, high) if u not in present]
        chosen = [left[i] for i in torch.randperm(len(left), generator=generator)[:take].tolist()]
    else:
        chosen = []
        while len(chosen) < take:
            for u in torch.randint(low, high, (2 * take,), generator=generator).tolist():
                if u not in present and len(chosen) < take:
                    present.add(u)
                    chosen.append(u)
    present.update(chosen)
    return chosen


def _removed_item(
    batch: Any,
    rows: int,
    changed: tuple[int, ...],
    unit_of_row: list[int] | None,
    keep_fields: frozenset[int],
    items: _Items | None,
    generator: torch.Generator,
) -> int:
    """The one changed example (unit) pass B removes, drawn at random. Where the changed units differ in
    size, half the time the largest (3/4) or the smallest (a weight relative to the batch's largest user
    moves the others only when that user goes); else, half the time with users, one holding an id field's
    extreme: a replaced user that keeps its own id (a field in another form than ``user_key``'s, or no
    user left out of the batch to take the id of) shows a dependence on its id only when removed."""
    units = None if items is None else items.units
    if units is not None:
        sizes = units.rows_per_unit().tolist()
        if len({sizes[u] for u in changed}) > 1 and draw(generator) < 0.5:
            by_size = sorted(changed, key=lambda u: sizes[u])
            return by_size[-1] if draw(generator) < 0.75 else by_size[0]
    if unit_of_row is not None and keep_fields and draw(generator) < 0.5:
        extremes = [unit_of_row[r] for r in id_extremes(batch, rows, keep_fields)]
        changing = set(changed)
        candidates = [u for u in dict.fromkeys(extremes) if u in changing]
        if candidates:
            return candidates[pick(generator, len(candidates))]
    return changed[pick(generator, len(changed))]


def draw(generator: torch.Generator) -> float:
    """A uniform number in [0, 1) from the check's generator."""
    return float(torch.rand((), generator=generator))


def pick(generator: torch.Generator, count: int) -> int:
    """One of ``count`` items, drawn uniformly from the check's generator."""
    return min(count - 1, int(draw(generator) * count))
