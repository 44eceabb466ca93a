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

from lightning_dp.errors import DPConfigurationError

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
    if isinstance(value, float) and math.isnan(value):
        return True
    return isinstance(value, Tensor) and value.numel() == 1 and bool(value.isnan().any())


def _relabel(raw: Sequence[Any] | Tensor | np.ndarray, owner: str) -> UserIds:
    """Sorted distinct ids → 0..U−1 (vectorised for integer tensors and arrays)."""
    array = raw.detach().cpu().numpy() if isinstance(raw, Tensor) else raw
    if isinstance(array, np.ndarray) and array.dtype.kind in "iub":
        distinct, inverse = np.unique(array, return_inverse=True)
        return UserIds(torch.from_numpy(inverse.astype(np.int64)), [x.item() for x in distinct])
    values = [_plain(v) for v in (array.tolist() if isinstance(array, np.ndarray) else raw)]
    missing = sum(_missing(v) for v in values)
    if missing:
        raise DPConfigurationError(
            f"{owner}: {missing} of {len(values)} examples have no user id (None or NaN). Every example must "
            "belong to a user: give them an id (each its own user, if they are one person's), or drop them "
            "from the training set."
        )
    shared = sum(isinstance(v, (list, tuple, set, frozenset)) for v in values)
    if shared:
        raise DPConfigurationError(f"{owner}: {shared} examples list several user ids. {_ONE_OWNER}")
    try:
        unique = sorted(set(values))
    except TypeError:  # ids of mixed types: a deterministic order all ranks agree on
        unique = sorted(set(values), key=lambda v: (type(v).__name__, repr(v)))
    label = {value: index for index, value in enumerate(unique)}
    return UserIds(torch.tensor([label[v] for v in values], dtype=torch.long), list(unique))


def _plain(value: Any) -> Any:
    """A 0-d tensor or numpy scalar as its Python value (hashable, comparable)."""
    if isinstance(value, Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, np.generic):
        return value.item()
    return value


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
