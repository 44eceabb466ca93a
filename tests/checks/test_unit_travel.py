"""A user's rows stay that user's (issue #45): the privacy unit follows its rows through every collate, chunk,
epoch and normalisation.

Each test goes through the Trainer with the checks at their defaults (or ``"every_step"`` where several
batches are needed), and the neighbour test removes a whole user through the real Trainer: one step, σ = 0,
every user sampled, with and without the user.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import make_trainer
from lightning.pytorch import LightningModule
from neighbour import released_sum
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, Subset, default_collate

from lightning_dp import DPConfigurationError, DPStrategy, PrivacyCallback, UserPoisson, checking
from lightning_dp.checks.row_draws import RowDraws
from lightning_dp.sampling.user_ids import resolve_user_ids

MIXING = "Sensitivity check failed"


class Rows(Dataset):
    """Items (x, y, user id); ``users`` is the attribute ``user_key="users"`` reads."""

    def __init__(self, x: Tensor, y: Tensor, users: Tensor) -> None:
        self.x, self.y, self.users = x, y, users

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, Tensor]:
        return self.x[i], self.y[i], self.users[i]


def rows_of(counts: list[int], seed: int = 0, d: int = 6) -> Rows:
    """Users with ``counts[u]`` records each (user u's raw id 3u + 7), scattered over the data set."""
    g = torch.Generator().manual_seed(seed)
    owner = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    owner = owner[torch.randperm(len(owner), generator=g)]
    x = torch.randn(len(owner), d, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return Rows(x, y, owner * 3 + 7)


def group_of(user: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's user index in the batch (0..U_b−1) and each user's row count in the batch."""
    _, group = torch.unique(user, return_inverse=True)
    return group, torch.bincount(group)


def per_user_mean(losses: Tensor, user: Tensor) -> Tensor:
    """Σ_u mean_{r∈u} ℓ_r: each user's mean loss, summed over the batch's users."""
    group, counts = group_of(user)
    return (losses / counts[group].to(losses)).sum()


def relative_to_largest(losses: Tensor, user: Tensor) -> Tensor:
    """Each row weighted by its user's row count over the batch's largest user's."""
    group, counts = group_of(user)
    return (losses * (counts[group] / counts.max()).to(losses)).mean()


LOSSES: dict[str, Callable[[Tensor, Tensor, int], Tensor]] = {
    # correct: no other user's rows, nor their number, enter a user's gradient
    "row_mean": lambda losses, user, users_per_step: losses.mean(),
    "per_user_mean_over_users_per_step": lambda losses, user, users_per_step: (
        per_user_mean(losses, user) / users_per_step
    ),
    "per_user_sum": lambda losses, user, users_per_step: losses.sum(),
    "per_user_mean": lambda losses, user, users_per_step: per_user_mean(losses, user),
    # incorrect: they read the other users' counts
    "per_user_mean_over_batch_users": lambda losses, user, users_per_step: (
        per_user_mean(losses, user) / len(torch.unique(user))
    ),
    "relative_to_largest_user": lambda losses, user, users_per_step: relative_to_largest(losses, user),
}


class UserNet(LightningModule):
    """An MLP over ``data``'s users; ``loss`` names a :data:`LOSSES` entry; ``drop``: input dropout."""

    def __init__(
        self,
        data: Dataset,
        loss: str = "row_mean",
        drop: float = 0.0,
        collate: Any = None,
        users_per_step: int = 8,
    ) -> None:
        super().__init__()
        self.data, self.loss, self.drop, self.collate = data, loss, drop, collate
        self.users_per_step = users_per_step
        self.net = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
        self.seen: list[Tensor] = []

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=32, collate_fn=self.collate)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y, user = batch
        if not checking():
            self.seen.append(user)
        losses = F.cross_entropy(self.net(F.dropout(x, self.drop)), y, reduction="none")
        return LOSSES[self.loss](losses, user, self.users_per_step)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def users_dp(users_per_step: int = 8, k: int = 4, **kwargs: Any) -> DPStrategy:
    args = dict(noise_multiplier=1.0, privacy_unit="user", user_key="users", examples_per_user=k,
                users_per_step=users_per_step, seed=0)  # fmt: skip
    return DPStrategy(**{**args, **kwargs})


def fit(module: LightningModule, strategy: DPStrategy, steps: int = 2, **trainer: Any) -> DPStrategy:
    make_trainer(strategy, max_steps=steps, max_epochs=100, **trainer).fit(module)
    return strategy


SMALL = [1 + u % 4 for u in range(24)]  # 24 users of 1 to 4 records


# -- 1. the unit travels with its rows through the collate_fn ----------------------------------------------
def _sorted_by_key(
    items,
):  # sort by a feature, as a length sort for pack_padded_sequence(enforce_sorted=True)
    return default_collate(sorted(items, key=lambda item: float(item[0][0])))


def _shuffled(items):
    return default_collate([items[i] for i in torch.randperm(len(items)).tolist()])


def _reversed(items):
    return default_collate(items[::-1])


def _dropped(items):
    return default_collate(items[:-1])


def _duplicated(items):
    return default_collate([items[0], *items])


class TupleNet(UserNet):
    def training_step(self, batch, batch_idx):
        return super().training_step(tuple(batch[:3]), batch_idx)


def _by_key(items):
    return sorted(range(len(items)), key=lambda i: float(items[i][0][0]))


def _sorted_ids_in_fetch_order(items):  # the data sorted, the user ids left in the items' order
    x, y, user = default_collate(items)
    order = torch.tensor(_by_key(items))
    return x[order], y[order], user


def _sorted_with_fetch_order_field(items):  # sorted items, and a constant-length field built in fetch order
    x, y, user = default_collate([items[i] for i in _by_key(items)])
    return x, y, user, torch.stack([item[0][:2].abs() for item in items])


@pytest.mark.parametrize(
    ("collate", "match"),
    [
        (_sorted_by_key, "does not keep each item in its place"),
        (_shuffled, "does not keep each item in its place"),
        (_reversed, "does not keep each item in its place"),
        (_dropped, "another number of rows"),
        (_duplicated, "another number of rows"),
        (_sorted_ids_in_fetch_order, "does not keep each item in its place"),
        (_sorted_with_fetch_order_field, "does not keep each item in its place"),
    ],
)
def test_a_collate_that_reorders_drops_or_duplicates_items_is_refused_by_name(collate, match):
    with pytest.raises(DPConfigurationError, match=match) as refusal:
        fit(TupleNet(rows_of(SMALL), collate=collate), users_dp(), steps=1)
    assert f"collate_fn {collate.__name__}" in str(refusal.value)
    assert "enforce_sorted=False" in str(refusal.value)


def _padded_dict(items):  # variable-length rows padded in the items' order, returned as a dict
    x = nn.utils.rnn.pad_sequence([item[0][: 3 + int(item[1])] for item in items], batch_first=True)
    x = F.pad(x, (0, 6 - x.shape[1]))
    return {
        "x": x,
        "y": torch.stack([item[1] for item in items]),
        "user": torch.stack([item[2] for item in items]),
        "position": torch.arange(len(items)),  # a field read by position, not by item
    }


def _randomly_masked(items):  # a masked-model collator: a random mask drawn over the whole batch
    x, y, user = default_collate(items)
    return x * (torch.rand(x.shape) > 0.15), y, user


def _with_constant(items):  # a tuple with a field that is the same for every item
    x, y, user = default_collate(items)
    return x, y, user, torch.ones(len(items), 2)


def _padding_like_hf(items):  # DataCollatorWithPadding's dict: padded ids, their mask, labels, type ids
    ids = [(item[0][: 3 + int(item[1])] * 10).long().abs() for item in items]
    return {
        "input_ids": nn.utils.rnn.pad_sequence(ids, batch_first=True),
        "attention_mask": nn.utils.rnn.pad_sequence([torch.ones_like(i) for i in ids], batch_first=True),
        "token_type_ids": torch.zeros(len(items), max(len(i) for i in ids), dtype=torch.long),
        "labels": torch.stack([item[1] for item in items]),
        "x": torch.stack([item[0] for item in items]),
        "user": torch.stack([item[2] for item in items]),
    }


class DictNet(UserNet):
    def training_step(self, batch, batch_idx):
        return super().training_step(
            (batch["x"], batch.get("y", batch.get("labels")), batch["user"]), batch_idx
        )


class TimeMajor(UserNet):
    """Its collate puts the features time-major ([6, B], as pad_sequence(batch_first=False)) after the labels."""

    def training_step(self, batch, batch_idx):
        y, user, x = batch
        return super().training_step((x.T, y, user), batch_idx)


def _sorted_time_major(
    items,
):  # the features sorted (for pack_padded_sequence), time-major; the rest in order
    x = torch.stack([items[i][0] for i in _by_key(items)])
    return (
        torch.stack([item[1] for item in items]),
        torch.stack([item[2] for item in items]),
        x.T.contiguous(),
    )


def _distinct_items_only(items):  # a padding collate with a position field that refuses repeated items
    if len({id(item) for item in items}) < len(items):
        raise ValueError("repeated item")
    return _padded_dict(items)


def test_a_collate_that_cannot_take_repeated_items_is_refused_by_name_when_a_field_needs_the_third_collate():
    with pytest.raises(DPConfigurationError, match="raised ValueError when lightning-dp collated copies"):
        fit(DictNet(rows_of(SMALL), collate=_distinct_items_only), users_dp(), steps=1)


def test_a_sorting_collate_is_refused_when_its_sorted_field_is_time_major():
    with pytest.raises(DPConfigurationError, match="does not keep each item in its place"):
        fit(TimeMajor(rows_of(SMALL), collate=_sorted_time_major), users_dp(), steps=1)


@pytest.mark.parametrize(
    "collate",
    [None, _padded_dict, _randomly_masked, _with_constant, _padding_like_hf],
    ids=["default", "padded", "masked", "constant field", "hf-like padding"],
)
def test_a_collate_that_keeps_its_items_in_place_trains(collate):
    net = DictNet if collate in (_padded_dict, _padding_like_hf) else TupleNet
    module = net(rows_of(SMALL), collate=collate)
    strategy = fit(module, users_dp(check_sensitivity="every_step"), steps=3)
    assert strategy.engine.steps == 3
    assert len(strategy.checks.mixing.checked_steps) >= 2


def test_at_1024_users_a_padding_collate_with_a_position_field_trains_and_a_sort_with_ids_in_order_is_refused():
    data = rows_of([1 + u % 2 for u in range(2048)])
    strategy = fit(DictNet(data, collate=_padded_dict), users_dp(1024, k=2), steps=1)
    assert strategy.engine.steps == 1
    with pytest.raises(DPConfigurationError, match="does not keep each item in its place"):
        fit(TupleNet(data, collate=_sorted_ids_in_fetch_order), users_dp(1024, k=2), steps=1)


def test_augmented_views_keep_their_example_through_the_collate_and_order_is_free_without_units():
    class Views(Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return torch.randn(6, generator=g) + 0.1 * torch.randn(6), torch.tensor(i % 3), torch.tensor(i)

    with pytest.raises(DPConfigurationError, match="does not keep each item in its place"):
        fit(
            UserNet(Views(), collate=_sorted_by_key),
            DPStrategy(noise_multiplier=1.0, augmentation_multiplicity=2),
        )
    # each row its own unit: the order carries nothing, and a sorting collate trains
    strategy = fit(UserNet(Views(), collate=_sorted_by_key), DPStrategy(noise_multiplier=1.0, seed=0))
    assert strategy.engine.steps == 2


# -- 2. a unit's clipped gradient never depends on another unit, through the library's rescaling either -------
CORRECT = [
    ("row_mean", "mean", "batch"),
    ("per_user_mean_over_users_per_step", "mean", "public"),
    ("per_user_sum", "sum", "batch"),
    ("per_user_mean", "sum", "batch"),
]


@pytest.mark.parametrize("drop", [0.0, 0.3], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize(("loss", "reduction", "normalisation"), CORRECT, ids=[c[0] for c in CORRECT])
def test_a_correct_per_user_loss_trains_under_the_checks_with_and_without_random_draws(
    loss, reduction, normalisation, drop
):
    module = UserNet(rows_of(SMALL), loss, drop)
    strategy = fit(module, users_dp(loss_reduction=reduction, check_sensitivity="every_step"), steps=3)
    assert strategy.engine.steps == 3
    assert len(strategy.checks.mixing.checked_steps) == 3
    assert strategy.engine.normalisation == normalisation


WRONG = ["per_user_mean_over_batch_users", "relative_to_largest_user"]
LARGEST = [6, *[1 + u % 3 for u in range(23)]]  # one user larger than every other


@pytest.mark.parametrize("drop", [0.0, 0.3], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("loss", WRONG)
def test_a_loss_that_reads_other_users_counts_is_refused_with_and_without_random_draws(loss, drop):
    module = UserNet(rows_of(LARGEST), loss, drop)
    with pytest.raises(DPConfigurationError, match=MIXING) as refusal:
        fit(module, users_dp(24, k=6, check_sensitivity="every_step"), steps=6)
    assert "removed" in str(refusal.value)  # one whole user removed, also when the step draws random numbers


def test_a_mean_over_the_rows_returned_under_loss_reduction_sum_is_refused_with_its_fix():
    """Under loss_reduction="sum" a mean over the batch's rows divides each user's gradient by the batch's
    rows, the other users' counts: refused, and the refusal says to return the sum."""
    with pytest.raises(DPConfigurationError, match=MIXING) as refusal:
        fit(UserNet(rows_of(SMALL), "row_mean"), users_dp(loss_reduction="sum"), steps=2)
    assert "while loss_reduction='sum'" in str(refusal.value)
    assert "return the sum" in str(refusal.value)


class SizeTimesLoss(LightningModule):
    """Example level: dropout, and a loss scaled by the parity of the batch's size (on the size alone)."""

    def __init__(self, n: int, batch_size: int, scaled: bool) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
        self.batch_size, self.scaled = batch_size, scaled
        self.net = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Dropout(0.3), nn.Linear(12, 3))

    def train_dataloader(self):
        return DataLoader(list(zip(self.x, self.y, strict=True)), batch_size=self.batch_size)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(F.dropout(x, 0.2)), y)
        return loss * (1 + len(x) % 2) if self.scaled else loss  # the size's parity: no content moves it

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.parametrize("batch_size", [8, 1024])
def test_with_random_draws_the_check_removes_an_example_and_sees_a_dependence_on_the_batch_size(batch_size):
    strategy = fit(
        SizeTimesLoss(4 * batch_size, batch_size, scaled=False), DPStrategy(noise_multiplier=1.0, seed=0)
    )
    assert strategy.checks.mixing.checked_steps[:1] == [0]
    with pytest.raises(DPConfigurationError, match=r"when the batch had one example removed"):
        fit(SizeTimesLoss(4 * batch_size, batch_size, scaled=True), DPStrategy(noise_multiplier=1.0, seed=0))


def test_row_draws_give_every_kept_row_its_own_draws_and_report_what_they_cannot_align():
    x = torch.randn(6, 5)
    draws = RowDraws(6)
    with draws:
        a = (
            F.dropout(x, 0.5),
            torch.randn_like(x),
            torch.rand(6, 3),
            torch.empty(6, 2).normal_(),
            torch.rand(4),
        )
    assert draws.aligned
    kept = [0, 2, 3, 5]
    again = RowDraws(6, draws.log, kept)
    with again:
        b = (F.dropout(x[kept], 0.5), torch.randn_like(x[kept]), torch.rand(4, 3), torch.empty(4, 2).normal_(),
             torch.rand(4))  # fmt: skip
    assert again.aligned
    for full, part in zip(a[:4], b[:4], strict=True):
        assert torch.equal(full[kept], part)
    assert torch.equal(a[4], b[4])  # not the batch's shape: the same values
    lstm = nn.LSTM(5, 4, num_layers=2, dropout=0.5, batch_first=True)
    built_in = RowDraws(6)
    with built_in:
        lstm(x[:, None])  # a layer's own dropout draws outside any function RowDraws knows
    assert not built_in.aligned


# -- the neighbour test: one whole user removed, through the real Trainer ---------------------------------------
def user_move(data: Rows, removed_user: int, c: float, **strategy: Any) -> float:
    """One step, σ = 0, every user sampled with all their rows, with and without ``removed_user``'s rows, of a
    per-user loss divided by the run's users_per_step (as the mean over users is)."""
    users = len(torch.unique(data.users))
    k = int(torch.unique(data.users, return_counts=True)[1].max())
    rest = Subset(data, [i for i in range(len(data)) if int(data.users[i]) != removed_user])
    rest.users = data.users[rest.indices]  # type: ignore[attr-defined]
    sums = []
    for part, count in ((data, users), (rest, users - 1)):
        torch.manual_seed(0)  # the same initial weights on both data sets
        module = UserNet(part, "per_user_mean_over_users_per_step", users_per_step=count)
        capture = released_sum(
            module, part, lambda count=count: users_dp(count, k, noise_multiplier=0.0, max_grad_norm=c, **strategy),
            batch_size=len(part),
        )  # fmt: skip
        assert capture.sums is not None
        sums.append(capture.sums)
    return math.sqrt(sum(float((a - b).square().sum()) for a, b in zip(*sums, strict=True)))


@pytest.fixture(scope="module")
def population() -> Rows:
    """256 users: one of 500 records (raw id 7) and 255 of one record."""
    return rows_of([500] + [1] * 255, seed=1)


@pytest.mark.parametrize("removed", [7, 10], ids=["500-record user", "1-record user"])
def test_removing_a_whole_user_moves_the_released_sum_by_at_most_c_at_256_users(population, removed):
    c = 5.0  # the one-record users are not clipped: a rescaling of theirs would show
    assert user_move(population, removed, c) <= c * (1 + 1e-3)


def test_the_neighbour_test_sees_the_leak_of_a_per_user_loss_rescaled_by_the_batchs_rows(population):
    """The same loss with the per-row rescaling by the rows' count forced (checks off: the batch reading),
    as before issue #45: without the 500-record user every other user's gradient moves, far beyond C."""
    c = 5.0
    assert user_move(population, 7, c, check_sensitivity=False) > 3 * c


# -- 2b. the step keeps the batch's rows in their order: a reordering inside training_step is refused by name ------
STEP_ORDER = "so the step's rows are not the batch's rows in their order"


def _halves_swapped(t: Tensor) -> Tensor:
    return torch.cat([t[len(t) // 2 :], t[: len(t) // 2]])


REORDERS: dict[str, Callable[[Tensor], Tensor]] = {
    "randperm": lambda t: t[torch.randperm(len(t), generator=torch.Generator().manual_seed(len(t)))],
    "drawn randperm": lambda t: t,  # replaced in the step by a permutation from the global stream
    "flip": lambda t: t.flip(0),
    "roll": lambda t: t.roll(3, 0),
    "halves swapped": _halves_swapped,
}


class Reordering(UserNet):
    """Reorders the batch's rows (x and y together, so every row keeps its label) before the layers."""

    def __init__(self, data: Dataset, reorder: str, drop: float = 0.0) -> None:
        super().__init__(data, drop=drop)
        self.reorder = reorder

    def training_step(self, batch, batch_idx):
        x, y, user = batch[:3]
        if self.reorder == "drawn randperm":
            perm = torch.randperm(len(x))
            x, y = x[perm], y[perm]
        else:
            x, y = REORDERS[self.reorder](x), REORDERS[self.reorder](y)
        return super().training_step((x, y, user), batch_idx)


@pytest.mark.parametrize("reorder", list(REORDERS))
def test_a_step_that_reorders_the_batchs_rows_is_refused_by_name_before_the_first_release(reorder):
    """Each row's user is known by its position: rows reordered in the step before any layer (the data carry no
    autograd history) would be clipped with other users' rows. Refused on the first checked batch, by name."""
    strategy = users_dp()
    with pytest.raises(DPConfigurationError, match=STEP_ORDER) as refusal:
        fit(Reordering(rows_of(SMALL), reorder), strategy, steps=2)
    assert strategy.engine.steps == 0
    assert "isolate_examples=True" in str(refusal.value)


@pytest.mark.parametrize("reorder", ["flip", "drawn randperm"])
def test_a_reordering_step_moves_the_released_sum_past_c_when_unchecked(reorder):
    """Without the check the reordering moves the released sum by more than C when one whole user goes: what
    the refusal above prevents."""
    data = rows_of(SMALL)
    users = len(torch.unique(data.users))
    k = max(SMALL)
    removed = 3 * SMALL.index(k) + 7  # the raw id of a largest user (rows_of: user u has raw id 3u + 7)
    rest = Subset(data, [i for i in range(len(data)) if int(data.users[i]) != removed])
    rest.users = data.users[rest.indices]  # type: ignore[attr-defined]
    c = 1e-3
    sums = []
    for part, count in ((data, users), (rest, users - 1)):
        torch.manual_seed(0)
        capture = released_sum(
            Reordering(part, reorder), part,
            lambda count=count: users_dp(count, k, noise_multiplier=0.0, max_grad_norm=c, check_sensitivity=False),
            batch_size=len(part),
        )  # fmt: skip
        assert capture.sums is not None
        sums.append(capture.sums)
    move = math.sqrt(sum(float((a - b).square().sum()) for a, b in zip(*sums, strict=True)))
    assert move > c * 1.05


def test_a_correct_per_user_step_with_dropout_trains_under_every_step_checks_with_units_in_another_order():
    """The order pass gives every row its own dropout mask wherever its user sits (no false refusal)."""
    strategy = fit(UserNet(rows_of(SMALL), "per_user_mean", drop=0.3), users_dp(loss_reduction="sum",
                   check_sensitivity="every_step"), steps=4)  # fmt: skip
    assert strategy.engine.steps == 4
    assert len(strategy.checks.mixing.checked_steps) == 4


def test_row_draws_replay_each_rows_own_draws_when_the_same_rows_come_in_another_order():
    x = torch.randn(6, 5)
    draws = RowDraws(6)
    with draws:
        a = (F.dropout(x, 0.5), torch.randn(6, 3), torch.rand(6, 2))
    order = [3, 4, 5, 0, 1, 2]
    again = RowDraws(6, draws.log, order)
    with again:
        b = (F.dropout(x[order], 0.5), torch.randn(6, 3), torch.rand(6, 2))
    assert again.aligned
    for full, moved in zip(a, b, strict=True):
        assert torch.equal(full[order], moved)


class BatchStandardised(UserNet):
    """Standardises the batch by its own mean and std (mixes users) and keeps every row in its place."""

    def training_step(self, batch, batch_idx):
        x, y, user = batch[:3]
        return super().training_step(((x - x.mean(0)) / (x.std(0) + 1e-3), y, user), batch_idx)


def test_a_step_that_mixes_users_in_place_keeps_the_general_refusal_not_the_order_one():
    """The order pass names a refusal only when the units' gradients depend on where they sit: a batch
    statistic moves them wherever they sit, and it is refused as mixing, not as a reordering."""
    with pytest.raises(DPConfigurationError, match=MIXING) as refusal:
        fit(BatchStandardised(rows_of(SMALL)), users_dp(), steps=2)
    assert STEP_ORDER not in str(refusal.value)


def test_the_order_pass_runs_on_refused_batches_only(monkeypatch):
    """No dry pass is added to a batch the removal passes (what a correct step pays is unchanged); a refused
    batch of a reordering step runs it and is named."""
    import lightning_dp.checks.mixing as mixing

    calls: list[int] = []

    def counted(*args: Any) -> bool:
        calls.append(1)
        return order_moves(*args)

    order_moves = mixing.order_moves
    monkeypatch.setattr(mixing, "order_moves", counted)
    strategy = fit(UserNet(rows_of(SMALL), drop=0.3), users_dp(check_sensitivity="every_step"), steps=3)
    assert len(strategy.checks.mixing.checked_steps) == 3
    assert not calls
    with pytest.raises(DPConfigurationError, match=STEP_ORDER):
        fit(Reordering(rows_of(SMALL), "flip"), users_dp(), steps=2)
    assert calls


# -- 3. every physical chunk is checked ----------------------------------------------------------------------------
def test_mixing_in_a_later_physical_chunk_is_refused():
    """The first chunk holds one user alone (nothing to compare); users mix in the next chunks."""
    data = rows_of([4] + [2] * 15)
    data.users = torch.where(data.users == 7, 1, data.users)  # the 4-record user has the smallest id: first

    class BatchCentred(UserNet):
        def training_step(self, batch, batch_idx):
            x, y, _ = batch
            return F.cross_entropy(self.net(x - x.mean(0)), y)

    with pytest.raises(DPConfigurationError, match=MIXING):
        fit(BatchCentred(data), users_dp(16, max_physical_batch_size=4), steps=1)
    strategy = fit(UserNet(data), users_dp(16, max_physical_batch_size=4), steps=2)
    assert strategy.checks.mixing.checked_steps[:1] == [0]


# -- 4. data changes are found by content ----------------------------------------------------------------------------
class Merging(UserNet):
    """Between epochs, merges two users in place (same data set object, same N)."""

    def on_train_epoch_end(self):
        self.data.users[self.data.users == 10] = 7


@pytest.mark.parametrize("change", [False, True], ids=["same ids", "ids edited in place"])
def test_user_ids_edited_in_place_between_epochs_are_read_again_and_refused(change):
    module = (Merging if change else UserNet)(rows_of(SMALL))
    strategy = users_dp(24)
    trainer = make_trainer(strategy, max_epochs=2, reload_dataloaders_every_n_epochs=1)
    if not change:
        trainer.fit(module)
        assert strategy.engine.steps == 2
        return
    with pytest.raises(DPConfigurationError, match="the user ids changed during the run"):
        trainer.fit(module)
    assert strategy.engine.steps == 1  # refused before the second epoch's first release


def test_an_example_level_bound_reads_ids_again_and_prices_a_public_change():
    for public in (False, True):
        module = Merging(rows_of(SMALL))
        strategy = DPStrategy(noise_multiplier=1.0, seed=0, user_key="users", max_examples_per_user=2,
                              data_changes="public" if public else "refuse")  # fmt: skip
        trainer = make_trainer(  # no report: its group-privacy bound is not what this test is about
            strategy,
            max_epochs=2,
            reload_dataloaders_every_n_epochs=1,
            callbacks=[PrivacyCallback(report=False)],
        )
        if public:
            trainer.fit(module)
            assert strategy.engine.steps == trainer.global_step > 1
        else:
            with pytest.raises(DPConfigurationError, match="the user ids changed during the run"):
                trainer.fit(module)


# -- 5. any id a user can hold is one user; others are refused by name ------------------------------------------------
def test_every_kind_of_id_a_user_can_hold_is_one_user():
    kinds = [
        [("org", 1), ("org", 2), ("org", 1)],
        [torch.tensor(3), torch.tensor([3]), np.int64(4)],
        [np.array(2.5), 2.5, np.float32(1.0)],
        ["b", "a", "b"],
        [frozenset({1, 2}), frozenset({2, 1}), frozenset({3})],
    ]
    for ids in kinds:
        users = resolve_user_ids(range(3), ids)
        assert users.num_users == 2, ids
        assert users.user_of_example[0] == users.user_of_example[1 if ids[0] == ids[1] else 2]
    sampler = UserPoisson(user_key=lambda i: ("org", i // 3), examples_per_user=3, users_per_step=4, seed=0)
    module = UserNet(rows_of(SMALL))
    strategy = fit(module, DPStrategy(noise_multiplier=1.0, sampler=sampler, privacy_unit="user", seed=0))
    assert strategy.privacy_unit is not None
    assert strategy.privacy_unit.num_units == math.ceil(len(module.data) / 3)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (torch.tensor([1, 2]), "Tensor of several values"),
        (np.array([1, 2]), "ndarray of several values"),
        ({"org": 1}, "dict, which cannot be hashed"),
        ([1, 2], "list, which lists several ids"),
    ],
    ids=["tensor", "array", "dict", "list"],
)
def test_an_id_that_is_not_one_hashable_value_is_refused_by_name_at_fit(bad, match):
    data = rows_of(SMALL)
    strategy = users_dp(user_key=lambda i: bad if i == 5 else i // 2)
    with pytest.raises(DPConfigurationError, match=match):
        fit(UserNet(data), strategy, steps=1)
