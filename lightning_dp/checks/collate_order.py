"""The collate check: every row of a collated batch is the item fetched at its position, so it keeps its unit.

The sampler knows which privacy unit (a user, an example with its augmented views) each fetched item
belongs to, by the item's position in the list it hands the ``collate_fn``; the engine then groups the
collated batch's rows by that position. A ``collate_fn`` that sorts its items (by length, for
``pack_padded_sequence(enforce_sorted=True)``), buckets or shuffles them, or drops, duplicates or merges
some, would have rows of different users clipped together and one user split over several units.

Each batch whose rows carry two units or more is collated twice, from the same global random state: as
fetched, and with its units in a random order (and each unit's examples in a random order, its views kept
together), which a unit's own rows may take. A collate that keeps every item in its place gives the second
batch's rows in that order; a row count other than the items', or a per-example field whose rows come back
as a permutation of the first batch's rows but not in that order, is refused, by name, with the fix. A field
the collate draws at random (a masked-language-model collator's masks) is not a permutation of the other's
rows: it is no evidence either way, and the fields it does not draw show the order.

A field that comes back the same, row for row, whatever the items' order is either not built from the items
(a ``torch.arange`` of positions, a constant-length buffer) or placed by their content: a sort gives every
order the same rows. One such field in a batch whose other fields follow the fetch order (an index or an id
field built in fetch order, beside the sorted data) would have the engine group sorted rows by fetch
positions. So the batch is collated a third time, from copies of one item: a field the same there too is
not built from the items; any other is refused. A per-example field is a tensor with the batch on
dimension 0, a list of one value per item, or a tensor with the batch on dimension 1 only (time-major,
``pad_sequence(batch_first=False)``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection

from lightning_dp.checks.batch_edit import _field_hashes, per_example_fields
from lightning_dp.checks.snapshot import GlobalRNG
from lightning_dp.core.batches import UnitInfo, batch_length
from lightning_dp.core.errors import DPConfigurationError

_FIX = (
    "Keep one row per item, in the items' order: sort where the model needs it (pack_padded_sequence(..., "
    "enforce_sorted=False) sorts inside the layer and gives the rows back in the batch's order), and drop or "
    "filter items in the Dataset, not in the collate_fn."
)


def collate_in_order(
    collate_fn: Callable[[list[Any]], Any], items: list[Any], units: UnitInfo, probe: random.Random
) -> Any:
    """``collate_fn(items)``, refused unless its rows are the items in their order (``units``: each item's
    unit, as the sampler drew them; ``probe``: draws the other order). Nothing is checked for one unit."""
    if units.num_units < 2 or units.unit_of_row.numel() != len(items):
        return collate_fn(items)
    rng = GlobalRNG(torch.device("cpu"))
    before = rng.state()
    batch = collate_fn(items)
    rows = len(items)
    if batch_length(batch) is None:  # no tensor at all: nothing the engine groups
        return batch
    if not _holds_rows(batch, rows):
        raise DPConfigurationError(count_message(collate_fn))
    after = rng.state()
    order = unit_order(units, probe)
    rng.restore(before)
    try:
        moved = collate_fn([items[i] for i in order])
    except Exception as error:
        raise DPConfigurationError(unreorderable_message(collate_fn, error)) from error
    finally:
        rng.restore(after)
    refused, same = _reordered(batch, moved, order, rows)
    if refused or not _holds_rows(moved, rows):
        raise DPConfigurationError(order_message(collate_fn))
    if same and _built_from_items(collate_fn, items, batch, same, rng, (before, after)):
        raise DPConfigurationError(order_message(collate_fn))
    return batch


def _built_from_items(
    collate_fn: Callable[[list[Any]], Any],
    items: list[Any],
    batch: Any,
    same: list[int],
    rng: GlobalRNG,
    states: tuple[tuple[Any, ...], tuple[Any, ...]],
) -> bool:
    """Whether a field at positions ``same`` (the same in every order) changes when every item is a copy of
    the first: it is built from the items, so it was placed by their content (``states``: the global random
    state before the first collate, restored for this one, and after it, restored after)."""
    rows = len(items)
    rng.restore(states[0])
    try:
        copies = collate_fn([items[0]] * rows)
    except Exception as error:
        raise DPConfigurationError(uncopyable_message(collate_fn, error)) from error
    finally:
        rng.restore(states[1])
    first, third = _fields(batch, rows), _fields(copies, rows)
    if len(first) != len(third):
        return True
    return any(not _same_field(first[i], third[i], rows) for i in same)


def _fields(batch: Any, rows: int) -> list[torch.Tensor | list[Any]]:
    """The per-example fields of ``batch``: :func:`per_example_fields`, then every tensor with the batch on
    dimension 1 only (time-major), its rows first."""
    found = per_example_fields(batch, rows)
    apply_to_collection(
        batch,
        torch.Tensor,
        lambda t: (
            found.append(t.transpose(0, 1)) if t.dim() > 1 and t.shape[0] != rows == t.shape[1] else None
        ),
    )
    return found


def _same_field(a: torch.Tensor | list[Any], b: torch.Tensor | list[Any], rows: int) -> bool:
    """Whether two per-example fields hold the same rows in the same places."""
    if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
        return False
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape != b.shape:
        return False
    return _field_hashes(a, rows) == _field_hashes(b, rows)


def unit_order(units: UnitInfo, probe: random.Random) -> list[int]:
    """A random order of the rows that moves whole units (never the identity when there are two) and each
    unit's examples among themselves, an example's ``views`` consecutive rows kept together."""
    unit_of_row = units.unit_of_row.cpu().tolist()
    views = max(units.views, 1)
    blocks: dict[int, list[list[int]]] = {}
    for row in range(0, len(unit_of_row), views):
        blocks.setdefault(unit_of_row[row], []).append(list(range(row, min(row + views, len(unit_of_row)))))
    names = list(blocks)
    shuffled = names[:]
    probe.shuffle(shuffled)
    if shuffled == names:
        shuffled = names[1:] + names[:1]
    order: list[int] = []
    for unit in shuffled:
        examples = blocks[unit][:]
        probe.shuffle(examples)
        order += [row for example in examples for row in example]
    return order


def _holds_rows(batch: Any, rows: int) -> bool:
    """Whether a tensor of ``batch`` has one row per item on dimension 0."""
    found: list[bool] = []
    apply_to_collection(batch, torch.Tensor, lambda t: found.append(t.dim() > 0 and t.shape[0] == rows))
    return any(found)


def _reordered(batch: Any, moved: Any, order: list[int], rows: int) -> tuple[bool, list[int]]:
    """Whether a per-example field of ``moved`` (collated in ``order``) holds the rows of ``batch``'s, but
    not in ``order`` (the collate placed its items by their content, or at random, not by position), or no
    field shows the items in ``order`` while one is the same in both batches (the sorted batch); and the
    positions of the fields (:func:`_fields`) the same in both, row for row, which a sort gives too."""
    first, second = _fields(batch, rows), _fields(moved, rows)
    if len(first) != len(second):
        return True, []
    reordered = kept = 0
    same: list[int] = []
    for position, (a, b) in enumerate(zip(first, second, strict=True)):
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            return True, []
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape != b.shape:
            return True, []
        real, probe = _field_hashes(a, rows), _field_hashes(b, rows)
        if len(set(real)) == 1:
            continue  # a constant field follows any order
        if all(probe[j] == real[i] for j, i in enumerate(order)):
            kept += 1
        elif probe == real:
            same.append(position)
        elif sorted(real) == sorted(probe):
            reordered += 1
    return reordered > 0 or (bool(same) and kept == 0), same


def _name(collate_fn: Callable[..., Any]) -> str:
    name = getattr(collate_fn, "__qualname__", None) or type(collate_fn).__qualname__
    return f"The collate_fn {name}"


def order_message(collate_fn: Callable[..., Any]) -> str:
    """The refusal for a collate that does not keep its items in place (no statistic of the batch)."""
    return (
        f"{_name(collate_fn)} does not keep each item in its place: collated again with whole units in "
        "another order, its rows did not follow them (it sorts, buckets or shuffles its items, or drops, "
        "duplicates or merges some of them). Each row's privacy unit (its user, or the example its augmented "
        "views come from) is known by the position of the item it comes from, so rows of different units "
        "would be clipped together and one unit split over several, and one user could move the released sum "
        f"by more than max_grad_norm. Nothing was released. {_FIX}"
    )


def count_message(collate_fn: Callable[..., Any]) -> str:
    """The refusal for a collate that returns another number of rows than items."""
    return (
        f"{_name(collate_fn)} returns another number of rows than the items it was given: it drops, "
        "duplicates or merges items (sequence packing, filtering). Each row's privacy unit is known by the "
        "position of the item it comes from, so the rows cannot be grouped by unit. Nothing was released. "
        f"{_FIX}"
    )


def uncopyable_message(collate_fn: Callable[..., Any], error: BaseException) -> str:
    """The refusal for a collate that fails on copies of one of its items (the exception's type only: its
    text may hold the batch's shapes)."""
    return (
        f"{_name(collate_fn)} raised {type(error).__name__} when lightning-dp collated copies of one of its "
        "items, to check that a field that comes back the same in any order of the items is not placed by "
        "their content (a sort). Nothing was released. Let the collate_fn take repeated items. " + _FIX
    )


def unreorderable_message(collate_fn: Callable[..., Any], error: BaseException) -> str:
    """The refusal for a collate that fails on its batch's items in another order."""
    text = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
    return (
        f"{_name(collate_fn)} raised {type(error).__name__}{': ' + text if text else ''} when lightning-dp "
        "collated the same items with whole units in another order, to check that each row stays with its "
        "privacy unit. Nothing was released. Let the collate_fn take its items in any order. " + _FIX
    )
