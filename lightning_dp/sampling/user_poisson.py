"""Poisson sampling over users (user-level DP, ULS; ``docs/user-level.md``).

Each step every user joins independently with probability q_u = users_per_step / U; each sampled user
contributes min(n_u, k) of their examples, chosen with randomness that does not depend on other users. The
engine clips the mean (or sum) of a user's rows as one unit (the batch carries a ``UnitInfo``), so one user
moves the released sum by at most C and each step is DP-SGD's subsampled Gaussian with U users in place
of N examples: ``PoissonGaussian(σ, q_u)``, whatever k is. The divisor is the public ``users_per_step``.

The user index is a CSR layout built once (example indices grouped by user, and offsets), so a step costs
O(rows drawn) after the Poisson draw over users. Under DDP rank r owns the users u ≡ r (mod world size): a
user's rows never straddle ranks (a unit clipped in two halves would have sensitivity 2C).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Literal

import numpy as np
import torch

from lightning_dp.accounting import PoissonGaussian, PrivacyEvent
from lightning_dp.core.batches import IndicesWithInfo, UnitInfo
from lightning_dp.core.draws import poisson_share
from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.core.validation import number
from lightning_dp.sampling.contribution_bound import (
    bounded_examples,
    first_per_segment,
    segment_positions,
    user_index,
)
from lightning_dp.sampling.seeded import DrawnBatches, SeededSampler
from lightning_dp.sampling.user_ids import (
    UserIds,
    UserKey,
    changed_users_message,
    resolve_user_ids,
    same_users,
)

__all__ = ["UserPoisson"]

Selection = Literal["random", "cycle"]
Reduction = Literal["mean", "sum"]


class UserPoisson(SeededSampler):
    """Poisson sampling of users at q_u = users_per_step / U, at most ``examples_per_user`` rows per user.

    Args:
        user_key: where each example's user id is (``lightning_dp.sampling.user_ids``): a column or attribute
            name, an item key, a sequence or 1-D tensor aligned with the dataset's indices, or a callable.
        examples_per_user: k, the most rows one sampled user contributes to a step (public).
        users_per_step: B_u, the expected users per step (public): q_u = B_u / U and the gradient's divisor.
        selection: which rows of a user with more than k: ``"random"`` (a uniform k-subset each time) or
            ``"cycle"`` (the next k of the user's examples in a fixed order, wrapping; the position lives in
            memory only, and restarts at a random offset after a resume).
        reduction: a user's rows are reduced by ``"mean"`` (default) or ``"sum"`` before the clip.
        max_examples_per_user: cap each user's examples before sampling (a seeded per-user choice).
        seed: makes the draws reproducible (default: ``os.urandom``).
    """

    unit = "user"
    carries_batch_info = True
    takes_public_size = True  # each user joins w.p. q whatever U is: q may come from a declared U

    def __init__(
        self,
        user_key: UserKey | None = None,
        examples_per_user: int = 1,
        users_per_step: int = 1,
        selection: Selection = "random",
        reduction: Reduction = "mean",
        max_examples_per_user: int | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__(seed)
        owner = "UserPoisson"
        self.user_key = user_key
        self.examples_per_user = int(
            number(examples_per_user, "examples_per_user", owner=owner, low=1, integer=True)
        )
        self.users_per_step = int(number(users_per_step, "users_per_step", owner=owner, low=1, integer=True))
        self.max_examples_per_user = number(
            max_examples_per_user, "max_examples_per_user", owner=owner, low=1, integer=True, optional=True
        )
        if selection not in ("random", "cycle"):
            raise DPConfigurationError(
                f"UserPoisson: selection must be 'random' or 'cycle', got {selection!r}."
            )
        if reduction not in ("mean", "sum"):
            raise DPConfigurationError(f"UserPoisson: reduction must be 'mean' or 'sum', got {reduction!r}.")
        self.selection: Selection = selection
        self.reduction: Reduction = reduction
        self.rank, self.world_size = 0, 1
        self._dataset: Any = None
        self.users: UserIds | None = None
        self._order = self._offsets = self._counts = np.zeros(0, dtype=np.int64)
        self._cursor: np.ndarray | None = None  # "cycle": each user's next position (memory only)
        self._warned_batch = False

    # -- set-up ---------------------------------------------------------------------------------------
    def bind_dataset(self, dataset: Any) -> None:
        """Read every example's user id and build the CSR user index. A train loader set up again in the run
        (``reload_dataloaders_every_n_epochs``, a second fit) has its ids read again, also from the same data
        set object: ids edited in place (two users merged, labels used as ids relabelled) are refused."""
        users = resolve_user_ids(dataset, self.user_key, owner="UserPoisson")
        if self.users is not None and self._dataset is not None:
            if not same_users(self.users, users):
                raise ValueError(changed_users_message("UserPoisson"))
        else:
            self._index(users)
        self._dataset = dataset

    def _index(self, users: UserIds) -> None:
        self.users = users
        user_of_example = users.user_of_example
        if self.max_examples_per_user is not None:  # cap n_u before sampling; the dropped count stays private
            kept = bounded_examples(users, self.max_examples_per_user, self.seed)
            order, offsets = user_index(user_of_example[kept], users.num_users)
            order = kept[order]
        else:
            order, offsets = user_index(user_of_example, users.num_users)
        self._order, self._offsets = order.numpy(), offsets.numpy()
        self._counts = self._offsets[1:] - self._offsets[:-1]
        self._cursor = None

    def bind(self, num_samples: int, batch_size: int, rank: int = 0, world_size: int = 1) -> None:
        """Fix U and q_u = users_per_step / U; ``batch_size`` (rows) is not used for q."""
        if self.users is None:
            if self.user_key is None or isinstance(self.user_key, str):
                raise ValueError(
                    "UserPoisson needs the training set first (bind_dataset), or ids as user_key."
                )
            self._index(resolve_user_ids(range(num_samples), self.user_key, owner="UserPoisson"))
        assert self.users is not None
        if len(self.users.user_of_example) != num_samples:
            raise ValueError(
                f"UserPoisson read {len(self.users.user_of_example)} user ids but the training set has "
                f"{num_samples} examples: user_key must give one id per example."
            )
        num_users = self.users.num_users
        if num_users == 0:
            raise ValueError("The training set is empty: DP training needs at least one user.")
        size = num_users if self.public_size is None else self.public_size  # U as released: declared, or real
        if self.users_per_step > size:
            raise ValueError(
                f"users_per_step={self.users_per_step} is larger than the number of users U={size}: the "
                f"sample rate q = users_per_step / U would exceed 1. Use users_per_step ≤ {size}."
            )
        rows = self.users_per_step * self.examples_per_user
        if not self._warned_batch and not rows / 2 <= batch_size <= 2 * rows:
            self._warned_batch = True
            warnings.warn(
                f"UserPoisson draws about users_per_step × examples_per_user = {rows} rows a step; the "
                f"DataLoader's batch_size={batch_size} is not used for sampling (q = users_per_step / U). Set "
                f"batch_size={rows} to make the two agree, and max_physical_batch_size to bound memory.",
                stacklevel=4,
            )
        self.num_samples = num_users  # the privacy unit is the user: U is the N of the ledger and checkpoint
        self.sample_rate = self.users_per_step / size
        self.rank, self.world_size = rank, world_size
        generator = self._start_stream(f"user_poisson/{rank}")
        if self.selection == "cycle" and (self._cursor is None or len(self._cursor) != num_users):
            # a random starting point per user, from this run's stream: nothing about past steps is kept
            uniform = torch.rand(num_users, generator=generator, dtype=torch.float64).numpy()
            self._cursor = (uniform * self._counts).astype(np.int64)

    @property
    def expected_batch_size(self) -> float:
        """B_u, the public divisor of the summed clipped user gradients."""
        return float(self.users_per_step)

    def batches_per_epoch(self, num_samples: int, batch_size: int) -> int:
        """An epoch samples each user once in expectation: ⌈U / users_per_step⌉ steps."""
        del num_samples, batch_size
        return max(1, math.ceil(self.size_for_releases / self.users_per_step))

    # -- sampling -------------------------------------------------------------------------------------
    def draw(self) -> IndicesWithInfo:
        """One step: this rank's users, each w.p. q_u; min(n_u, k) rows of each, grouped by user."""
        assert self.generator is not None, "bind() first"
        num_users = len(self._counts)
        drawn = poisson_share(num_users, self.sample_rate, self.generator, self.rank, self.world_size)
        users = drawn.numpy()
        counts = self._counts[users]
        if self.selection == "cycle":
            rows, unit_of_row = self._cycle(users, counts)
        else:
            rows, unit_of_row = self._random(users, counts)
        assert self.users is not None
        ids = tuple(
            (self.users.raw_ids[u], u) for u in users.tolist()
        )  # how a batch field may name each user
        unit_map = UnitInfo(torch.from_numpy(unit_of_row), self.reduction, ids=ids)
        return IndicesWithInfo(rows.tolist(), unit_map)

    def _random(self, users: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A uniform min(n_u, k)-subset of each user's rows: one uniform key per row, the k smallest kept."""
        segment, position = segment_positions(counts)
        rows = self._order[self._offsets[users][segment] + position]
        if len(counts) == 0 or int(counts.max()) <= self.examples_per_user:
            return rows, segment
        keys = torch.rand(len(rows), generator=self.generator, dtype=torch.float64).numpy()
        chosen = np.sort(first_per_segment(segment, position, keys, self.examples_per_user))
        return rows[chosen], segment[chosen]  # each user's rows in dataset order

    def _cycle(self, users: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The next min(n_u, k) of each user's rows in index order, wrapping: no repeat within a step."""
        assert self._cursor is not None
        taken = np.minimum(counts, self.examples_per_user)
        segment, step = segment_positions(taken)
        start = self._cursor[users]
        position = (start[segment] + step) % counts[segment]
        rows = self._order[self._offsets[users][segment] + position]
        self._cursor[users] = (start + taken) % np.maximum(counts, 1)
        return rows, segment

    def batch_sampler(self, num_batches: int) -> DrawnBatches:
        assert self.generator is not None, "bind() first"
        return DrawnBatches(self.draw, num_batches)

    def event(self, noise_multiplier: float) -> PrivacyEvent:
        """One step: the Poisson-subsampled Gaussian over users (k does not enter)."""
        return PoissonGaussian(noise_multiplier=noise_multiplier, sample_rate=self.sample_rate)
