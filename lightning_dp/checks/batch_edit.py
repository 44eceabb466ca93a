"""Editing a batch by examples: remove or replace whole examples, every per-example field together.

The mixing check compares the user's step on a batch and on the same batch with some examples changed.
The changed batch must be one the loader could yield: each example's fields move together, and nothing
else changes. A *per-example field* is

* a tensor whose dimension 0 is the batch (``rows``),
* a list or tuple of ``rows`` values of one type (strings, numbers, variable-length tensors, dicts: what
  the default ``collate_fn`` makes of non-tensor fields, or what a custom one returns per example),

found anywhere in the batch: in dicts and other mappings, lists, tuples, namedtuples and dataclasses. A
list or tuple of ``rows`` values each of which holds a batch-first tensor is the batch's structure (the
fields of a batch of ``rows`` examples), not one value per example. Everything else (constants, a shared
mask, scalars) is left as it is.

When the user's step cannot run on a batch with examples removed (it reshapes by a group size made in the
``collate_fn``, or pairs rows another way), :func:`run_on_changed_batch` falls back to replacing them by
copies of other examples (every shape the same); when even that fails, it refuses with the cause and the
fix: the check never ends a run with the user's own exception from a batch the loader cannot yield.
"""

from __future__ import annotations

import copy
import dataclasses
import zlib
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor

from lightning_dp.checks.fingerprint import row_hashes
from lightning_dp.core.batches import batch_length
from lightning_dp.core.errors import DPConfigurationError, quote_error

T = TypeVar("T")

_ATOMS = (str, bytes, int, float, complex, bool, type(None))
_MAX_DEPTH = 32
"""Nesting followed into a batch (deeper values are left as they are)."""


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _is_dataclass_instance(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def _batched(t: Any, rows: int) -> bool:
    return isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == rows


def _holds_batched(x: Any, rows: int, depth: int = 0) -> bool:
    """Whether ``x`` is, or holds anywhere inside, a tensor whose dimension 0 is the batch."""
    if depth > _MAX_DEPTH:
        return False
    if isinstance(x, Tensor):
        return _batched(x, rows)
    if isinstance(x, _ATOMS):
        return False
    if isinstance(x, Mapping):
        return any(_holds_batched(v, rows, depth + 1) for v in x.values())
    if isinstance(x, list | tuple):
        return any(_holds_batched(v, rows, depth + 1) for v in x)
    if _is_dataclass_instance(x):
        return any(_holds_batched(getattr(x, f.name), rows, depth + 1) for f in dataclasses.fields(x))
    return False


def is_per_example_sequence(x: Any, rows: int) -> bool:
    """A list or tuple holding one value per example: ``rows`` values of one type, not the batch's fields.

    ``(x, y)`` with two examples is two fields (each holds a batch-first tensor); ``["a", "b"]`` or two
    variable-length token tensors are two examples' values."""
    if not isinstance(x, list | tuple) or _is_namedtuple(x) or len(x) != rows or rows == 0:
        return False
    first = type(x[0])
    if any(type(v) is not first for v in x):
        return False  # heterogeneous: the fields of a structure (a tensor, a dict of strings, ...)
    return not all(_holds_batched(v, rows) for v in x)


def _rebuild_sequence(x: list[Any] | tuple[Any, ...], items: list[Any]) -> Any:
    if _is_namedtuple(x):
        return type(x)(*items)
    try:
        return type(x)(items)
    except Exception:  # a subclass with another constructor
        return tuple(items) if isinstance(x, tuple) else items


def _rebuild_mapping(x: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    if type(x) is dict:
        return items
    if isinstance(x, defaultdict):
        return defaultdict(x.default_factory, items)
    try:  # OrderedDict, UserDict and its subclasses (a Hugging Face BatchEncoding), AttributeDict
        out = copy.copy(x)
        for key, value in items.items():
            out[key] = value  # type: ignore[index]
        return out
    except Exception:
        try:
            return type(x)(items)  # type: ignore[call-arg]
        except Exception:
            return items


def map_examples(
    batch: Any,
    rows: int,
    on_tensor: Callable[[Tensor], Tensor],
    on_values: Callable[[list[Any]], list[Any]],
) -> Any:
    """``batch`` with every per-example field mapped (``on_tensor`` for batch-first tensors, ``on_values``
    for per-example lists and tuples, given and returning a list); containers keep their types."""

    def walk(x: Any, depth: int) -> Any:
        if depth > _MAX_DEPTH or isinstance(x, _ATOMS):
            return x
        if isinstance(x, Tensor):
            return on_tensor(x) if _batched(x, rows) else x
        if isinstance(x, Mapping):
            return _rebuild_mapping(x, {k: walk(v, depth + 1) for k, v in x.items()})
        if isinstance(x, list | tuple):
            if is_per_example_sequence(x, rows):
                return _rebuild_sequence(x, on_values(list(x)))
            return _rebuild_sequence(x, [walk(v, depth + 1) for v in x])
        if _is_dataclass_instance(x):
            out = copy.copy(x)
            for f in dataclasses.fields(x):
                object.__setattr__(out, f.name, walk(getattr(x, f.name), depth + 1))
            return out
        return x

    return walk(batch, 0)


def per_example_fields(batch: Any, rows: int) -> list[Tensor | list[Any]]:
    """Every per-example field of ``batch`` (batch-first tensors, and per-example values as lists)."""
    found: list[Tensor | list[Any]] = []

    def tensor(t: Tensor) -> Tensor:
        found.append(t)
        return t

    def values(v: list[Any]) -> list[Any]:
        found.append(v)
        return v

    map_examples(batch, rows, tensor, values)
    return found


def _value_hash(value: Any) -> int:
    """A hash of one example's non-tensor value, the same in every process (not Python's salted hash)."""
    if isinstance(value, Tensor):
        flat = value.detach().reshape(1, -1)
        return int(row_hashes(flat, 1)[0]) if flat.numel() else 0
    return zlib.crc32(repr(value).encode("utf-8", "backslashreplace"))


# -- the helpers the mixing check calls (their signatures are the check's contract) ----------------------------


def _different_row(
    batch: Any,
    rows: int,
    row: int,
    kept: list[int],
    draw: int,
    hashes: list[int] | None = None,
    kept_hashes: set[int] | None = None,
) -> int:
    """A kept row of the batch (``draw``-th), preferring one whose content differs from ``row``'s
    (``hashes``, ``kept_hashes``: the batch's :func:`_example_hashes` and those of the ``kept`` rows, when the
    caller computed them once for many rows)."""
    if hashes is None:
        hashes = _example_hashes(batch, rows)
    if hashes is not None and kept_hashes is not None and hashes[row] not in kept_hashes:
        return kept[draw % len(kept)]  # no kept row has this content: every one differs
    if hashes is not None:
        differing = [i for i in kept if hashes[i] != hashes[row]]
        if differing:
            return differing[draw % len(differing)]
    return kept[draw % len(kept)]


def _field_hashes(field_: Tensor | list[Any], rows: int) -> list[int]:
    """One hash per example of one per-example field."""
    if isinstance(field_, Tensor):
        return [int(h) for h in row_hashes(field_, rows).cpu().tolist()]
    return [_value_hash(v) for v in field_]


def _example_hashes(batch: Any, rows: int) -> list[int] | None:
    """One hash per example over all its per-example fields (None when the batch has none)."""
    fields = per_example_fields(batch, rows)
    if not fields:
        return None
    total = [0] * rows
    for field_ in fields:
        part = _field_hashes(field_, rows)
        total = [(a * 1_000_003 + b) & ((1 << 63) - 1) for a, b in zip(total, part, strict=True)]
    return total


def _id_like(field_: Tensor | list[Any], rows: int) -> bool:
    """One integer, string or flag per example: what a user id or an example index looks like."""
    if isinstance(field_, Tensor):
        return not (field_.is_floating_point() or field_.is_complex()) and field_.numel() == rows
    return all(isinstance(v, str | bytes | int) for v in field_)


def _plain(value: Any) -> Any:
    """A field's value for one row as a plain Python value (a one-element tensor or array, a NumPy scalar)."""
    if isinstance(value, Tensor):
        return value.reshape(-1)[0].item() if value.numel() == 1 else None
    item = getattr(value, "item", None)
    return item() if callable(item) and getattr(value, "size", 1) == 1 else value


def _row_values(field_: Tensor | list[Any], rows: int) -> list[Any]:
    if isinstance(field_, Tensor):
        return field_.reshape(rows, -1)[:, 0].tolist() if field_.numel() == rows else [None] * rows
    return [_plain(v) for v in field_]


def unit_id_fields(
    batch: Any, rows: int, unit_of_row: list[int], ids: tuple[tuple[Any, ...], ...] | None = None
) -> frozenset[int]:
    """The per-example fields (by position, in :func:`per_example_fields`' order) that name the row's unit.
    A row replaced by a copy of another unit's row keeps these, so it stays in its own unit instead of
    joining the other one (a per-user loss that groups rows by this id would otherwise see the kept user's
    rows change).

    A field names the unit when every row holds one of its unit's ``ids`` (the sampler's: the user's own id
    and its relabelled index; the mixing check then gives a replaced user the id of a user left out of the
    batch, :func:`id_forms`), or when it holds one integer or string per row, the same on every row of a
    unit and different between units (an id in another form, e.g. ``f"user-{id}"``, or an example's index
    shared by its augmented views): kept as it is. A label that happens to be constant per user and
    distinct between users is kept too, so a dependence on the batch's set of such labels shows only
    through the removed unit."""
    found: set[int] = set()
    if len(set(unit_of_row)) < 2:
        return frozenset()
    for position, field_ in enumerate(per_example_fields(batch, rows)):
        if not _id_like(field_, rows):
            continue
        if ids is not None:
            values = _row_values(field_, rows)
            if all(v is not None and v in ids[u] for v, u in zip(values, unit_of_row, strict=True)):
                found.add(position)
                continue
        of_unit: dict[int, int] = {}
        constant = all(
            of_unit.setdefault(u, h) == h
            for u, h in zip(unit_of_row, _field_hashes(field_, rows), strict=True)
        )
        if constant and len(set(of_unit.values())) == len(of_unit):
            found.add(position)
    return frozenset(found)


def id_forms(
    batch: Any, rows: int, unit_of_row: list[int], ids: tuple[tuple[Any, ...], ...], fields: frozenset[int]
) -> dict[int, int]:
    """For each id field (by position), which of its unit's ids every row holds: 0 for the user's own id,
    1 for its relabelled index (fields matching neither are left out)."""
    forms: dict[int, int] = {}
    for position, field_ in enumerate(per_example_fields(batch, rows)):
        if position not in fields:
            continue
        values = _row_values(field_, rows)
        for form in (0, 1):
            if all(v == ids[u][form] for v, u in zip(values, unit_of_row, strict=True)):
                forms[position] = form
                break
    return forms


def id_extremes(batch: Any, rows: int, fields: frozenset[int]) -> list[int]:
    """The rows holding the smallest and the largest value of each field in ``fields`` (the id fields a
    replaced row keeps): a dependence on one extreme user's id (a bonus for the batch's newest user)
    shows only when that user is removed."""
    found: list[int] = []
    for position, field_ in enumerate(per_example_fields(batch, rows)):
        if position not in fields:
            continue
        values = _row_values(field_, rows)
        order = sorted(range(rows), key=lambda r: (str(type(values[r])), values[r]))
        found += [order[0], order[-1]]
    return list(dict.fromkeys(found))


def _rows_of(
    batch: Any, rows: int, pick: Callable[[Tensor], Tensor], pick_list: Callable[[list[Any]], list[Any]]
) -> Any:
    """``batch`` with ``pick`` applied to each batch-first tensor and ``pick_list`` to each per-example
    list or tuple (see :func:`map_examples`)."""
    return map_examples(batch, rows, pick, pick_list)


def replace_rows(
    batch: Any,
    rows_changed: tuple[int, ...],
    sources: list[int],
    keep: frozenset[int] = frozenset(),
    relabel: Mapping[int, Mapping[int, Any]] | None = None,
) -> Any:
    """The batch with each example in ``rows_changed`` replaced by a copy of the matching ``sources`` example
    (every per-example field: tensors whose dim 0 is the batch, lists of per-example values): same shapes.
    The fields at positions ``keep`` (:func:`unit_id_fields`) are not copied: a changed row takes the value
    ``relabel[position][row]`` where given (the id of a user not in the batch), else keeps its own."""
    fresh = relabel or {}
    rows = batch_length(batch)
    assert rows is not None
    if not rows_changed:
        return batch
    target = torch.tensor(rows_changed, dtype=torch.long)
    source = torch.tensor(sources, dtype=torch.long)
    position = iter(range(1 << 62))  # the fields in per_example_fields' order

    def tensor(t: Tensor) -> Tensor:
        at = next(position)
        if at in keep:
            named = {r: v for r, v in fresh.get(at, {}).items() if r in set(rows_changed)}
            if not named:
                return t
            out = t.clone()
            rows_named = torch.tensor(list(named), dtype=torch.long, device=t.device)
            out.view(rows, -1)[rows_named] = torch.tensor(
                list(named.values()), dtype=t.dtype, device=t.device
            )[:, None]
            return out
        out = t.clone()
        out[target.to(t.device)] = t[source.to(t.device)]
        return out

    def values(x: list[Any]) -> list[Any]:
        at = next(position)
        out = list(x)
        if at in keep:
            for r in rows_changed:
                if r in fresh.get(at, {}):
                    out[r] = type(x[r])(fresh[at][r]) if isinstance(x[r], int | str) else fresh[at][r]
            return out
        for r, s in zip(rows_changed, sources, strict=True):
            out[r] = x[s]
        return out

    return _rows_of(batch, rows, tensor, values)


def remove_rows(batch: Any, rows_changed: tuple[int, ...], rows: int) -> Any:
    """The batch without the examples in ``rows_changed`` (every per-example field)."""
    keep = [i for i in range(rows) if i not in rows_changed]

    def tensor(t: Tensor) -> Tensor:
        return t.index_select(0, torch.tensor(keep, dtype=torch.long, device=t.device))

    return _rows_of(batch, rows, tensor, lambda x: [x[i] for i in keep])


# -- running the user's step on a changed batch -----------------------------------------------------------------


@dataclass(frozen=True)
class ChangedPass(Generic[T]):
    """What the step computed on the changed batch, and how the batch was changed in the end."""

    result: T
    removed: tuple[int, ...]
    replaced: tuple[int, ...]
    kept: list[int]
    """The kept examples' rows in the changed batch (in the order of the kept rows of the original)."""
    fallback: str | None = None
    """Why removing failed and replacement was used instead (the user's exception), if it did."""


def run_on_changed_batch(
    batch: Any,
    rows: int,
    removed: tuple[int, ...],
    replaced: tuple[int, ...],
    kept: list[int],
    draw: Callable[[int], int],
    run: Callable[[Any, int, list[int]], T],
    reset: Callable[[], None],
    keep_fields: frozenset[int] = frozenset(),
    relabel: Mapping[int, Mapping[int, Any]] | None = None,
) -> ChangedPass[T]:
    """``run(changed_batch, its_rows, kept_rows_in_it)`` on ``batch`` with the ``removed`` examples removed
    and the ``replaced`` ones replaced by copies of kept examples (``draw(n)`` picks among n).

    If the step raises on the batch with examples removed (a batch the loader may never yield: a reshape by a
    group size made in the ``collate_fn``), every changed example is replaced instead, so every shape stays
    as the loader makes it. If that raises too, a :class:`DPConfigurationError` quotes the step's exception
    and says what makes the model checkable. ``reset`` puts the module's state back before a second try.
    ``keep_fields``: fields a replaced example does not copy (its unit's id, :func:`unit_id_fields`); it takes
    ``relabel[field][row]`` where given, else keeps its own.
    """
    changed = removed + replaced

    def replacing(targets: tuple[int, ...]) -> Any:
        hashes = _example_hashes(batch, rows) if targets else None  # once, not once per row (O(B²))
        seen = {hashes[i] for i in kept} if hashes is not None else None
        sources = [_different_row(batch, rows, r, kept, draw(len(kept)), hashes, seen) for r in targets]
        return replace_rows(batch, targets, sources, keep_fields, relabel)

    first_error: BaseException | None = None
    if removed:
        edited = remove_rows(replacing(replaced), removed, rows)
        kept_after = [i - sum(r < i for r in removed) for i in kept]
        try:
            return ChangedPass(run(edited, rows - len(removed), kept_after), removed, replaced, kept_after)
        except Exception as error:  # the user's step on a batch the loader may never yield
            first_error = error
        reset()
    try:
        result = run(replacing(changed), rows, kept)
    except Exception as error:
        raise DPConfigurationError(_unrunnable_message(removed, changed, first_error, error)) from error
    fallback = None if first_error is None else quote_error(first_error)
    return ChangedPass(result, (), changed, list(kept), fallback)


def _unrunnable_message(
    removed: tuple[int, ...],
    changed: tuple[int, ...],
    removal_error: BaseException | None,
    replacement_error: BaseException,
) -> str:
    tried = []
    if removal_error is not None:
        tried.append(f"with {_examples(removed)} removed it raised {quote_error(removal_error)}")
    tried.append(
        f"with {_examples(changed)} replaced by copies of other examples of the batch it raised "
        f"{quote_error(replacement_error)}"
    )
    return (
        "The sensitivity check could not run your training_step on the sampled batch with some examples "
        f"changed: {'; '.join(tried)}. The check edits whole examples (every tensor whose dimension 0 is the "
        "batch, and every list or tuple of one value per example, together) and compares the other examples' "
        "gradients; a step that only runs on the batches your loader makes (rows grouped per example by the "
        "collate_fn, a field that pairs rows across examples, a batch size it asserts) cannot be checked that "
        "way. Nothing was released. To make it checkable, keep each example's rows on dimension 0 of every "
        "per-example tensor (K views as [B, K, ...], flattened inside training_step, not [B*K, ...] from the "
        "collate_fn) and let the step run on any number of distinct or repeated examples. Or pass "
        "DPStrategy(checks=Checks(isolate_examples=True)): each example then runs through training_step alone, so nothing "
        "can mix and nothing is edited (it costs one forward and backward per example). Only for a model "
        "verified otherwise (the neighbour test), DPStrategy(checks=Checks(sensitivity=False)) turns the check off, "
        "and then nothing verifies that its examples do not mix."
    )


def _examples(rows: tuple[int, ...]) -> str:
    """The changed examples, for a message: one by its position; several not listed (their positions and
    their number bound the private batch's size)."""
    return f"example {rows[0]}" if len(rows) == 1 else "some examples"
