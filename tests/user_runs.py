"""The user-level runs (issue #38, spec §5.7 test 7) that ``tests/ddp_worker.py`` makes on 2 processes and
``tests/test_ddp.py`` repeats on one: the same users, module and strategy arguments in both places."""

from __future__ import annotations

import math
from typing import Any

import torch
from conftest import TinyModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import UserPoisson, checking

NUM_USERS = 40
COUNTS = torch.arange(NUM_USERS) % 4 + 1  # users with 1, 2, 3 and 4 examples: N = 100


def user_ids() -> torch.Tensor:
    """Each example's raw user id: user u (relabelled index u) has ``COUNTS[u]`` rows scattered over the
    data set, and raw id 7u + 3 (ids are not 0..U−1, so the relabelling is exercised)."""
    owner = torch.repeat_interleave(torch.arange(NUM_USERS), COUNTS)
    scatter = torch.randperm(len(owner), generator=torch.Generator().manual_seed(0))
    return owner[scatter] * 7 + 3


def relabel(raw: torch.Tensor) -> torch.Tensor:
    """The user index 0..U−1 of each raw id (sorted order, as ``user_key`` is documented to relabel)."""
    return (raw - 3) // 7


class UserRows(TinyModule):
    """TinyModule over ``user_ids()``'s examples whose batches carry each row's dataset index, kept per step."""

    def __init__(self, batch_size: int) -> None:
        super().__init__(n=int(COUNTS.sum()), batch_size=batch_size)
        self.rows: list[list[int]] = []

    def train_dataloader(self) -> DataLoader:
        index = torch.arange(len(self.x))
        return DataLoader(TensorDataset(self.x, self.y, index), batch_size=self.batch_size)

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        if not checking():
            self.rows.append(index.tolist())
        return nn.functional.cross_entropy(self(x), y)


def user_strategy_args(k: int, users_per_step: int, **privacy: Any) -> dict[str, Any]:
    """``DPStrategy``/``DPDDPStrategy`` keyword arguments of a user-level run over ``user_ids()``."""
    return dict(
        privacy_unit="user", user_key=user_ids(), examples_per_user=k, users_per_step=users_per_step, seed=0,
        **privacy,
    )  # fmt: skip


RUNS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # σ = 0, C = ∞, every user every step (q_u = 1) with all their rows (k = max n_u): the union of the ranks'
    # users is the single-process batch, so the released gradient must be the same.
    "exact": (
        user_strategy_args(4, NUM_USERS, noise_multiplier=0.0, max_grad_norm=math.inf),
        {"max_epochs": 4},
    ),
    # The same with a clip that binds (C = 0.05), summed units, and physical chunks of 5 rows (units of ≤ 4 rows).
    "clipped": (
        user_strategy_args(
            4,
            NUM_USERS,
            noise_multiplier=0.0,
            max_grad_norm=0.05,
            unit_reduction="sum",
            max_physical_batch_size=5,
        ),
        {"max_epochs": 3},
    ),
    # q_u = 8/40 over 50 steps, k = 2 of up to 4 rows, σ calibrated to ε = 4: the ranks' draws and ε.
    "sampled": (user_strategy_args(2, 8, target_epsilon=4.0), {"max_epochs": 10}),
}


def batch_size(name: str) -> int:
    """The loader's batch size: the rows a step draws, about users_per_step × examples_per_user."""
    args = RUNS[name][0]
    return int(args["users_per_step"] * args["examples_per_user"])


def record_draws(sampler: UserPoisson) -> list[list[int]]:
    """Every batch of dataset indices ``sampler`` hands the loader (empty ones too), in order."""
    draws: list[list[int]] = []
    draw = sampler.draw

    def recorded():
        batch = draw()
        draws.append(list(batch))
        return batch

    sampler.draw = recorded  # type: ignore[method-assign]
    return draws
