"""Where each training example's user id comes from (``user_key``), relabelled to 0..U−1.

Resolution order on the train ``Dataset`` (``docs/user-level.md``): a sequence or 1-D tensor aligned with
the dataset's indices; a callable ``user_key(index)``; a string naming a Hugging Face ``datasets`` column,
an attribute of the dataset, or a key (or attribute) of every item (one pass over the data, with a warning).
Ids may be any hashable; they are relabelled in sorted order so every rank numbers the users alike.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Subset

from lightning_dp.core.errors import DPConfigurationError

UserKey = str | Sequence[Hashable] | Tensor | np.ndarray | Callable[[int], Hashable]
"""What ``user_key`` may be: a column/attribute/item-key name, ids aligned with indices, or a function."""

_ONE_OWNER = (
    "Each example must belong to exactly one user: examples shared by several users (multi-owner data) need "
    "a contribution bound over owners (Ganesh et al. 2025) that lightning-dp does not implement yet."
)


@dataclass(frozen=True)
class UserIds:
    """The user of every example: ``user_of_example`` (int64, length N, values 0..U−1) and the raw ids."""

    user_of_example: Tensor
    raw_ids: list[Hashable]
    """The original id of each relabelled user, in sorted order (``raw_ids[u]`` is user u's id)."""

    @property
    def num_users(self) -> int:
        return len(self.raw_ids)


def resolve_user_ids(dataset: Any, user_key: UserKey | None, owner: str = "DPStrategy") -> UserIds:
    """The user of each of ``len(dataset)`` examples, read through ``user_key``; refuses missing ids."""
    if user_key is None:
        raise DPConfigurationError(
            f"{owner}: user-level accounting needs user_key=..., where each example's user id is: a column or "
            "attribute name (e.g. user_key='user_id'), a sequence of ids aligned with the dataset's indices, or "
            "a function index -> id."
        )
    num_examples = len(dataset)
    raw = _read(dataset, user_key, num_examples, owner)
    if len(raw) != num_examples:
        raise DPConfigurationError(
            f"{owner}: user_key gives {len(raw)} user ids for a training set of {num_examples} examples; give "
            "exactly one id per example, aligned with the dataset's indices."
        )
    return _relabel(raw, owner)


def _read(dataset: Any, key: UserKey, num_examples: int, owner: str) -> Sequence[Any] | Tensor | np.ndarray:
    if isinstance(key, (Tensor, np.ndarray)):
        if key.ndim != 1:
            raise DPConfigurationError(
                f"{owner}: user_key as a tensor must be 1-D (one id per example), got shape {tuple(key.shape)}. "
                + _ONE_OWNER
            )
        return key
    if isinstance(key, str):
        return _read_named(dataset, key, num_examples, owner)
    if callable(key):
        return [key(index) for index in range(num_examples)]
    if isinstance(key, Sequence):
        return key
    raise DPConfigurationError(
        f"{owner}: user_key must be a name (str), a sequence or 1-D tensor of ids, or a callable index -> id; "
        f"got {type(key).__name__}."
    )


def _read_named(dataset: Any, key: str, num_examples: int, owner: str) -> Sequence[Any] | Tensor | np.ndarray:
    """A Hugging Face column, else an attribute of the dataset, else the key of every item (one pass).
    A ``torch.utils.data.Subset`` reads the column or attribute of the dataset it selects from."""
    if _is_column(dataset, key):
        return list(dataset[key])
    if _is_attribute(dataset, key):
        return getattr(dataset, key)
    if isinstance(dataset, Subset) and (
        _is_column(dataset.dataset, key) or _is_attribute(dataset.dataset, key)
    ):
        inner: Any = dataset.dataset
        whole = _read_named(inner, key, len(inner), owner)
        return [whole[i] for i in dataset.indices]
    warnings.warn(
        f"{owner}: user_key={key!r} is neither a column nor an attribute of {type(dataset).__name__}: reading "
        "it from every item loads each example once. Pass the ids directly (user_key=<sequence>) to skip this.",
        stacklevel=4,
    )
    ids = []
    for index in range(num_examples):
        item = dataset[index]
        if isinstance(item, Mapping) and key in item:
            ids.append(item[key])
        elif hasattr(item, key):
            ids.append(getattr(item, key))
        else:
            raise DPConfigurationError(
                f"{owner}: user_key={key!r} was not found on the dataset nor in example {index} "
                f"({type(item).__name__}). Name a column, a dataset attribute or an item key, or pass the ids."
            )
    return ids


def _is_column(dataset: Any, key: str) -> bool:
    """Whether ``key`` is a column of a Hugging Face ``datasets.Dataset`` (read whole, cheaply)."""
    columns = getattr(dataset, "column_names", None)
    return (
        type(dataset).__module__.startswith("datasets")
        and isinstance(columns, (list, tuple))
        and key in columns
    )


def _is_attribute(dataset: Any, key: str) -> bool:
    """Whether ``dataset.<key>`` is a sequence of ids (a tensor, an array or a list)."""
    value = getattr(dataset, key, None)
    return isinstance(value, (Tensor, np.ndarray, Sequence)) and not isinstance(value, str)


def _missing(value: Any) -> bool:
    if value is None:
        return True
    return isinstance(value, float) and math.isnan(value)


_ID_FIX = (
    "A user id must be one hashable value: an int, a string, a float, a tuple such as (org, user), or a "
    "0-d or 1-element tensor or NumPy value."
)


def _relabel(raw: Sequence[Any] | Tensor | np.ndarray, owner: str) -> UserIds:
    """Sorted distinct ids → 0..U−1 (vectorised for integer tensors and arrays). Every id a user can hold is
    read as one value (:func:`_plain`); an id that lists several users or cannot be hashed is refused by name."""
    array = _as_array(raw)
    if isinstance(array, np.ndarray) and array.dtype.kind in "iub":
        distinct, inverse = np.unique(array, return_inverse=True)
        return UserIds(torch.from_numpy(inverse.reshape(-1).astype(np.int64)), [x.item() for x in distinct])
    items = array.tolist() if isinstance(array, np.ndarray) and array.dtype != object else list(array)
    values = [_plain(v, index, owner) for index, v in enumerate(items)]
    missing = sum(_missing(v) for v in values)
    if missing:
        raise DPConfigurationError(
            f"{owner}: some examples have no user id (None or NaN). Every example must "
            "belong to a user: give them an id (each its own user, if they are one person's), or drop them "
            "from the training set."
        )
    unique = sorted(set(values), key=_order)
    label = {value: index for index, value in enumerate(unique)}
    return UserIds(torch.tensor([label[v] for v in values], dtype=torch.long), list(unique))


def _order(value: Any) -> tuple[Any, ...]:
    """A total order on ids that every process agrees on (Python's own is partial on sets and undefined
    across types; a set's iteration order depends on the process's hash seed): numbers, then strings, then
    bytes, tuples and frozensets element by element, anything else by its type and ``repr``."""
    if isinstance(value, bool | int | float):
        return (0, value)
    if isinstance(value, str):
        return (1, value)
    if isinstance(value, bytes):
        return (2, value)
    if isinstance(value, tuple):
        return (3, tuple(_order(v) for v in value))
    if isinstance(value, frozenset):
        return (4, tuple(sorted(_order(v) for v in value)))
    return (5, type(value).__qualname__, repr(value))


def _as_array(raw: Sequence[Any] | Tensor | np.ndarray) -> Sequence[Any] | np.ndarray:
    """A tensor of ids as a NumPy array (half-precision floats widened exactly), others as they are."""
    if not isinstance(raw, Tensor):
        return raw
    ids = raw.detach().cpu()
    if ids.dtype in (torch.float16, torch.bfloat16):
        ids = ids.double()
    return ids.numpy()


def _plain(value: Any, index: int = 0, owner: str = "DPStrategy") -> Any:
    """One example's id as a plain hashable Python value: a 0-d or 1-element tensor or array and a NumPy
    scalar become their value; a list or set (several owners), a multi-element tensor or array, or any
    other unhashable value is refused by name, with the fix."""
    if isinstance(value, Tensor | np.ndarray):
        if _size(value) == 1:
            return value.item()
        raise DPConfigurationError(
            f"{owner}: the user id of example {index} is a {type(value).__name__} of "
            f"{'several' if _size(value) else 'no'} values, not one id. {_ID_FIX} {_ONE_OWNER}"
        )
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list | set):
        raise DPConfigurationError(
            f"{owner}: the user id of example {index} is a {type(value).__name__}, which lists several ids. "
            f"{_ONE_OWNER} If it is one composite id, give it as a tuple. {_ID_FIX}"
        )
    try:
        hash(value)
    except TypeError:
        raise DPConfigurationError(
            f"{owner}: the user id of example {index} is a {type(value).__name__}, which cannot be hashed, so "
            f"it cannot name one user. {_ID_FIX}"
        ) from None
    return value


def _size(value: Tensor | np.ndarray) -> int:
    return int(value.size) if isinstance(value, np.ndarray) else value.numel()


def same_users(a: UserIds, b: UserIds) -> bool:
    """Whether two reads of the ids give the same users: the same id for every example."""
    return torch.equal(a.user_of_example, b.user_of_example) and a.raw_ids == b.raw_ids


def changed_users_message(owner: str) -> str:
    """The refusal for user ids that changed between two reads in one run (no statistic of them)."""
    return (
        f"{owner}: the user ids changed during the run: read again when the train loader was set up again "
        "(reload_dataloaders_every_n_epochs, another fit), the same examples now belong to other users (ids "
        "edited in place, users merged or split, labels used as ids changed). Which examples form a user, and "
        "how many users there are, would then be read from the training data without noise, and the ledger "
        "prices neither. Keep every example's user id fixed for the whole run, or train the new users in a new "
        "run (a new DPStrategy, whose ε adds to this one's)."
    )


def with_new_users(users: UserIds, sizes: Sequence[int]) -> Tensor | list[Hashable]:
    """A ``user_key`` for the examples ``users`` describes followed by ``len(sizes)`` new users (new user j
    owns the next ``sizes[j]`` examples), each with a fresh id no existing user has.

    The existing users keep their own ids, so whatever depends on a user's id (the contribution bound's
    choice of examples) is unchanged for them: an audit's canary users join the data without moving anyone.
    """
    raw = users.raw_ids
    ints = [v for v in raw if isinstance(v, int) and not isinstance(v, bool)]
    if (
        len(ints) == len(raw)
        and min(ints, default=0) >= -(2**63)
        and max(ints, default=0) + len(sizes) < 2**63
    ):
        start = max(ints, default=-1) + 1  # integer ids: the next integers
        fresh = torch.arange(start, start + len(sizes)).repeat_interleave(
            torch.as_tensor(sizes, dtype=torch.long)
        )
        return torch.cat([torch.tensor(ints, dtype=torch.long)[users.user_of_example], fresh])
    own = [raw[u] for u in users.user_of_example.tolist()]
    taken = set(raw)
    names = []
    for j in range(len(sizes)):
        name = f"lightning-dp-new-user-{j}"
        while name in taken:
            name += "'"
        names.append(name)
    return own + [name for name, size in zip(names, sizes, strict=True) for _ in range(size)]
