"""A contribution bound: at most k examples per user, the rest dropped before training (ELS, spec §1.6).

The user-level statement of an example-level run (``max_examples_per_user=k``) holds only if no user owns
more than k of the examples trained on, so the bound is enforced, not taken on trust (TF Privacy's is a
declaration). Which k examples a larger user keeps is a seeded pseudo-random choice that depends on that
user's own id and examples only, never on other users: removing one user leaves every other user's kept
examples unchanged, so the bounded data sets stay neighbours. How many examples were dropped is a
statistic of the private data and is neither logged nor reported.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Subset

from lightning_dp.core.validation import number
from lightning_dp.sampling.user_ids import UserIds, UserKey, resolve_user_ids

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def user_index(user_of_example: Tensor, num_users: int) -> tuple[Tensor, Tensor]:
    """The CSR layout of the users: ``order`` (example indices grouped by user, each user's in dataset order)
    and ``offsets`` (U+1): user u's examples are ``order[offsets[u]:offsets[u+1]]``."""
    order = torch.argsort(user_of_example, stable=True)
    counts = torch.bincount(user_of_example, minlength=num_users)
    offsets = torch.zeros(num_users + 1, dtype=torch.long)
    torch.cumsum(counts, 0, out=offsets[1:])
    return order, offsets


def segment_positions(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For segments of the given lengths laid end to end: each entry's segment and its position in it."""
    segment = np.repeat(np.arange(len(counts)), counts)
    starts = np.cumsum(counts) - counts
    return segment, np.arange(int(counts.sum())) - starts[segment]


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a well-spread 64-bit value from each 64-bit input (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _user_hash(raw_id: Hashable, seed: int | None) -> int:
    digest = hashlib.sha256(f"{seed}:{type(raw_id).__name__}:{raw_id!r}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def bounded_examples(users: UserIds, k: int, seed: int | None = None) -> Tensor:
    """Sorted indices of the examples kept when each user keeps at most ``k`` of theirs.

    A user with more than k examples keeps the k with the smallest keys, each key a hash of (seed, the
    user's id, the example's position among the user's examples): a fixed choice per user, independent of
    every other user, the same on every rank.
    """
    number(k, "max_examples_per_user", owner="ContributionBound", low=1, integer=True)
    order, offsets = user_index(users.user_of_example, users.num_users)
    counts = offsets[1:] - offsets[:-1]
    if len(counts) == 0 or int(counts.max()) <= k:
        return torch.arange(len(users.user_of_example))
    segment, position = segment_positions(counts.numpy())
    user_hashes = np.array([_user_hash(raw, seed) for raw in users.raw_ids], dtype=np.uint64)
    with np.errstate(over="ignore"):
        keys = _mix(user_hashes[segment] + position.astype(np.uint64) * _GOLDEN)
    chosen = first_per_segment(segment, position, keys, k)
    return torch.sort(order[torch.from_numpy(chosen)]).values


def first_per_segment(segment: np.ndarray, position: np.ndarray, keys: np.ndarray, k: int) -> np.ndarray:
    """Entries (of segments laid end to end) with one of the k smallest keys of their segment, grouped by
    segment: the one way every choice of "k of a user's examples" is made."""
    by_key = np.argsort(keys, kind="stable")
    grouped = by_key[np.argsort(segment[by_key], kind="stable")]  # by segment, each segment by key
    return grouped[position < k]  # the i-th entry of ``grouped`` is the position[i]-th of its segment


class ContributionBound:
    """Keeps at most ``max_examples_per_user`` examples of each user (``user_key`` says whose each is).

    ``apply(dataset)`` returns the bounded training set (a ``Subset``, the dataset itself when no user
    exceeds the bound); ``users`` then holds the resolved ids of the original dataset.
    """

    def __init__(self, user_key: UserKey, max_examples_per_user: int, seed: int | None = None) -> None:
        self.user_key = user_key
        self.max_examples_per_user = number(
            max_examples_per_user, "max_examples_per_user", owner="ContributionBound", low=1, integer=True
        )
        self.seed = seed
        self.users: UserIds | None = None

    def apply(self, dataset: Any, owner: str = "DPStrategy") -> Any:
        self.users = resolve_user_ids(dataset, self.user_key, owner=owner)
        kept = bounded_examples(self.users, self.max_examples_per_user, self.seed)
        if len(kept) == len(dataset):
            return dataset
        return Subset(dataset, kept.tolist())
