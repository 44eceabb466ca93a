"""The mixing check and isolate_examples with privacy units (issue #38, spec §3 ``checks/mixing.py``).

A unit (a user's rows, an example's augmented views) is clipped as one, so adding or removing a unit moves
the released sum by at most C however its own rows depend on each other: the check compares whole units,
allows mixing inside a unit and refuses mixing across units; ``isolate_examples=True`` runs each unit alone.
Everything here goes through the Trainer with the checks at their defaults.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyModule, make_trainer
from lightning.pytorch import LightningModule, seed_everything
from neighbour import released_sum
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, Subset

from lightning_dp import DPConfigurationError, DPStrategy, checking
from lightning_dp.checks.mixing_rows import choose_units
from lightning_dp.core.batches import UnitInfo

PER_USER = 4


class UserData(Dataset):
    """Items (x, y, user id); ``users`` is the attribute ``user_key="users"`` reads."""

    def __init__(self, x: Tensor, y: Tensor, users: Tensor) -> None:
        self.x, self.y, self.users = x, y, users

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, Tensor]:
        return self.x[i], self.y[i], self.users[i]


def user_mean(values: Tensor, user: Tensor) -> Tensor:
    """Each row's user's mean of ``values`` over the batch's rows of that user."""
    _, group = torch.unique(user, return_inverse=True)
    sums = values.new_zeros(int(group.max()) + 1, *values.shape[1:]).index_add(0, group, values)
    counts = torch.bincount(group).to(values).view(-1, *[1] * (values.dim() - 1))
    return (sums / counts)[group]


LOSSES = {
    # within one user: allowed
    "user_centred": lambda m, x, y, u: F.cross_entropy(m(x) - 0.5 * user_mean(m(x), u), y),
    "user_contrastive": lambda m, x, y, u: (
        F.cross_entropy(m(x), y) + (m(x) - user_mean(m(x), u)).square().sum(1).mean()
    ),
    # across users: refused
    "batch_centred": lambda m, x, y, u: F.cross_entropy(m(x) - 0.5 * m(x).mean(0), y),
    "batch_standardised": lambda m, x, y, u: F.cross_entropy(m((x - x.mean(0)) / (x.std(0) + 1e-5)), y),
    "batch_class_weights": lambda m, x, y, u: F.cross_entropy(
        m(x), y, weight=1.0 / torch.bincount(y, minlength=3).clamp(min=1).float()
    ),
    "extreme_record": lambda m, x, y, u: F.cross_entropy(m(x / x.norm(dim=1).max()), y),
}
ACROSS_USERS = ["batch_centred", "batch_standardised", "batch_class_weights", "extreme_record"]


class UserModule(TinyModule):
    """TinyModule over ``users`` users of up to ``PER_USER`` rows, whose batches carry the user id."""

    def __init__(self, loss: str, users: int = 24, batch_size: int = 32, **kwargs) -> None:
        g = torch.Generator().manual_seed(1)
        counts = torch.randint(1, PER_USER + 1, (users,), generator=g)
        owner = torch.repeat_interleave(torch.arange(users), counts)
        owner = owner[torch.randperm(len(owner), generator=g)] * 3 + 5  # scattered, raw ids not 0..U-1
        super().__init__(n=len(owner), batch_size=batch_size, **kwargs)
        self.users, self.loss_name = owner, loss

    def train_dataloader(self) -> DataLoader:
        return DataLoader(UserData(self.x, self.y, self.users), batch_size=self.batch_size)

    def training_step(self, batch, batch_idx):
        x, y, user = batch
        return LOSSES[self.loss_name](self, x, y, user)


def users_dp(users_per_step: int, **kwargs) -> DPStrategy:
    args = dict(noise_multiplier=1.0, privacy_unit="user", user_key="users", examples_per_user=PER_USER,
                users_per_step=users_per_step, seed=0)  # fmt: skip
    return DPStrategy(**{**args, **kwargs})


def fit_users(module: UserModule, users_per_step: int, steps: int = 2, **kwargs) -> DPStrategy:
    strategy = users_dp(users_per_step, **kwargs)
    make_trainer(strategy, max_steps=steps, max_epochs=100).fit(module)
    return strategy


def without_user(module: UserModule) -> tuple[UserData, Subset]:
    """The module's data set, and the same without the user of its first row (all of that user's rows)."""
    data = UserData(module.x, module.y, module.users)
    gone = module.users[0]
    return data, Subset(data, [i for i in range(len(data)) if module.users[i] != gone])


def user_neighbour_move(module: UserModule, make_strategy) -> tuple[float, float]:
    """One step (σ = 0, every user sampled with all their rows) with and without one whole user: how far
    the released sum moved, and C."""
    data, rest = without_user(module)
    users = len(torch.unique(module.users))
    full = released_sum(module, data, lambda: make_strategy(users), batch_size=len(data))
    kept = released_sum(module, rest, lambda: make_strategy(users - 1), batch_size=len(rest))
    assert full.sums is not None
    assert kept.sums is not None
    move = sum(float((a - b).square().sum()) for a, b in zip(full.sums, kept.sums, strict=True)) ** 0.5
    return move, full.strategy.engine.max_grad_norm


# -- (a) a loss coupling one user's own rows trains; removing a whole user moves the sum by at most C ----
@pytest.mark.parametrize("loss", ["user_centred", "user_contrastive"])
def test_a_loss_that_couples_a_users_own_rows_trains_under_the_default_checks(loss):
    module = UserModule(loss)
    before = [p.detach().clone() for p in module.parameters()]
    strategy = fit_users(module, users_per_step=8, steps=3)
    assert strategy.engine.steps == 3
    assert strategy.checks.mixing.checked_steps[:1] == [0]  # the first batch was checked, and passed
    assert any(not torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
    c = 1e-3
    move, bound = user_neighbour_move(
        UserModule(loss, users=12),
        lambda users: users_dp(users, noise_multiplier=0.0, max_grad_norm=c),
    )
    assert bound == c
    assert move <= c * (1 + 1e-4)
    # The same coupling read per example: the rows of one user are different examples, and it is refused.
    with pytest.raises(DPConfigurationError, match="mixes examples"):
        make_trainer(DPStrategy(noise_multiplier=1.0, seed=0), max_steps=1).fit(UserModule(loss))


def test_a_per_user_loss_with_dropout_trains_when_every_changed_user_is_replaced():
    """A step that draws random numbers gets every changed user replaced (same shapes, same masks): the
    copied rows keep their own user's id field, so they do not join a kept user's group in the loss."""
    LOSSES["user_centred_dropout"] = lambda m, x, y, u: F.cross_entropy(
        F.dropout(m(x), 0.3) - 0.5 * user_mean(m(x), u), y
    )
    try:
        for users, users_per_step in ((24, 8), (200, 128)):
            module = UserModule("user_centred_dropout", users=users, batch_size=users_per_step * PER_USER)
            strategy = fit_users(module, users_per_step=users_per_step, steps=1)
            assert strategy.checks.mixing.checked_steps == [0]
    finally:
        del LOSSES["user_centred_dropout"]


class Cancelling(LightningModule):
    """Users of two rows v and −v + w with ‖v‖ ≈ 4·10⁴ ≫ ‖w‖: each row's gradient is its input (through an
    exact tanh round trip), so a user's mean gradient w/2 is what is left after a large cancellation."""

    def __init__(self, users: int = 64, scale: float = 1e4) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 1, bias=False)
        g = torch.Generator().manual_seed(0)
        v, w = torch.randn(users, 16, generator=g) * scale, torch.randn(users, 16, generator=g)
        self.x = torch.stack([v, -v + w], 1).reshape(-1, 16)
        self.users = torch.arange(users).repeat_interleave(2)

    def train_dataloader(self) -> DataLoader:
        y = torch.zeros(len(self.x), dtype=torch.long)
        return DataLoader(UserData(self.x, y, self.users), batch_size=64)

    def training_step(self, batch, batch_idx):
        return self.layer(torch.tanh(batch[0] * 1e-4) * 1e4).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_a_correct_model_whose_users_rows_cancel_is_not_refused():
    """The rounding allowance counts a unit's rows as the sums add them (Σ_r w_r‖g_r‖), not the unit's small
    norm: recomputing rows of norm 4·10⁴ over other batches moves a cancelled unit by far more than its
    own norm's rounding, and a correct model must still train."""
    strategy = users_dp(32, check_sensitivity="every_step", max_grad_norm=1.0)
    make_trainer(strategy, max_steps=3, max_epochs=100).fit(Cancelling())
    assert len(strategy.checks.mixing.checked_steps) == 3


def test_under_virtual_batching_the_first_chunk_is_checked_with_its_own_users():
    """Chunks hold whole users; the check runs on the first with that chunk's unit map (renumbered)."""
    strategy = fit_users(UserModule("user_contrastive", users=40), 16, steps=2, max_physical_batch_size=8)
    assert strategy.checks.mixing.checked_steps[:1] == [0]
    with pytest.raises(DPConfigurationError, match="mixes users"):
        fit_users(UserModule("batch_centred", users=40), 16, steps=1, max_physical_batch_size=8)


@pytest.mark.parametrize("num_units", [2, 3, 8, 128])
def test_any_one_user_is_changed_with_probability_at_least_one_half(num_units):
    """Which units pass B changes: at least one kept, their number coprime with the units', every unit
    holding a field's extreme always (unless the batch is too small to keep about half), any unit with
    probability ≥ 1/2 (as rows are, alone)."""
    rows_per_unit = torch.arange(num_units) % 3 + 1
    units = UnitInfo(torch.repeat_interleave(torch.arange(num_units), rows_per_unit))
    rows = int(rows_per_unit.sum())
    x = torch.zeros(rows, 4)
    x[rows // 2] = 1.0  # the extreme
    extreme_unit = int(units.unit_of_row[rows // 2])
    g = torch.Generator().manual_seed(0)
    draws = 400
    counts = torch.zeros(num_units)
    for _ in range(draws):
        changed = choose_units((x,), units, torch.ones(rows, dtype=torch.float64),
                               torch.ones(num_units, dtype=torch.float64), g)  # fmt: skip
        kept = num_units - len(changed)
        assert kept >= 1
        assert math.gcd(kept, num_units) == 1
        assert extreme_unit in changed or num_units < 8  # a few units: all but a random quarter change
        counts[list(changed)] += 1
    rate = counts / draws
    assert float(rate.min()) >= 0.5 - 5 * math.sqrt(0.25 / draws)


# -- (b) coupling rows of different users is refused, in small and large batches ---------------------------
@pytest.mark.parametrize("loss", ACROSS_USERS)
@pytest.mark.parametrize(("users", "users_per_step"), [(24, 8), (200, 128)])
def test_a_loss_that_couples_rows_of_different_users_is_refused(loss, users, users_per_step):
    module = UserModule(loss, users=users, batch_size=users_per_step * PER_USER)
    with pytest.raises(DPConfigurationError, match="Sensitivity check failed") as refusal:
        fit_users(module, users_per_step=users_per_step, steps=1)
    message = str(refusal.value)
    assert "other users moved by" in message
    assert "mixes users" in message
    assert "isolate_examples=True" in message


def _newest_user_bonus(m, x, y, u):
    """Every step gives the batch's newest user (the largest id) 5 times its loss: a dependence on which
    other users are in the batch, read only through their ids."""
    losses = F.cross_entropy(m(F.dropout(x, m.drop)), y, reduction="none")
    newest = (u == u.max()).float()
    return losses.mean() + 5.0 * (losses * newest).sum() / newest.sum()


def _id_normalised_weights(m, x, y, u):
    """Each user weighted by its id over the sum of the batch's ids."""
    losses = F.cross_entropy(m(F.dropout(x, m.drop)), y, reduction="none")
    ids, group = torch.unique(u, return_inverse=True)
    weights = (ids + 1).double() / (ids + 1).double().sum()
    return (weights[group].float() * losses).sum() * 10


def _label_histogram(m, x, y, u):
    """Speaker identification: the label is the user's id; the target is smoothed by the batch's label
    histogram (a statistic of the other users' labels)."""
    logp = m(F.dropout(x, m.drop)).log_softmax(1)
    histogram = torch.bincount(u, minlength=logp.shape[1]).float()
    target = 0.9 * F.one_hot(u, logp.shape[1]).float() + 0.1 * histogram / histogram.sum()
    return -(target * logp).sum(1).mean()


class SpeakerModule(TinyModule):
    """``users`` speakers of ``PER_USER`` rows each, the user id in the batch (and as the label: classes =
    users); ``drop``: the input dropout that makes the check replace users instead of removing one."""

    def __init__(self, loss, drop: float, users: int = 96, users_per_step: int = 24) -> None:
        super().__init__(n=users * PER_USER, classes=users, batch_size=users_per_step * PER_USER)
        self.users = torch.arange(users).repeat_interleave(PER_USER)
        self.loss, self.drop = loss, drop

    def train_dataloader(self) -> DataLoader:
        return DataLoader(UserData(self.x, self.users, self.users), batch_size=self.batch_size)

    def training_step(self, batch, batch_idx):
        x, _, user = batch
        return self.loss(self, x, user, user)


@pytest.mark.parametrize("drop", [0.0, 0.2], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("loss", [_newest_user_bonus, _id_normalised_weights, _label_histogram])
def test_a_dependence_on_other_users_ids_is_refused_even_when_every_changed_user_is_replaced(loss, drop):
    """A replaced user keeps no id of its own: it becomes a user left out of the batch (its id in the form
    the field holds), so the batch's set of ids moves as between neighbours. Without dropout one user is
    removed, at random (half the time one holding an id's extreme), not always the first."""
    module = SpeakerModule(loss, drop)
    with pytest.raises(DPConfigurationError, match="Sensitivity check failed"):
        fit_users_of(module, users_per_step=24, steps=3, check_sensitivity="every_step")


def test_a_per_user_loss_keyed_by_a_derived_id_string_trains_and_fresh_ids_keep_groups_apart():
    """An id in another form than user_key's (``f"user-{id}"``) is kept as the copy's own; an exact id field
    gets the id of a user left out of the batch, so no replaced row joins a kept user's group."""

    class Named(SpeakerModule):
        def train_dataloader(self) -> DataLoader:
            names = [f"user-{int(u):03d}" for u in self.users]
            return DataLoader(list(zip(self.x, self.users, names, self.users, strict=True)), batch_size=96)

        def training_step(self, batch, batch_idx):
            x, y, names, user = batch
            order = sorted(set(names))
            group = torch.tensor([order.index(n) for n in names])
            losses = F.cross_entropy(self(F.dropout(x, 0.2)), y, reduction="none")
            centred = losses - user_mean(losses, group) + user_mean(losses, user)  # both ids group
            return (
                centred.mean()
                + torch.stack([losses[group == j].logsumexp(0) for j in range(len(order))]).mean()
            )

    strategy = fit_users_of(Named(None, 0.2), users_per_step=24, steps=2, check_sensitivity="every_step")
    assert strategy.checks.mixing.checked_steps == [0, 1]


def fit_users_of(module: SpeakerModule, users_per_step: int, steps: int, **kwargs) -> DPStrategy:
    strategy = DPStrategy(noise_multiplier=1.0, privacy_unit="user", user_key=module.users,
                          examples_per_user=PER_USER, users_per_step=users_per_step, seed=0, **kwargs)  # fmt: skip
    make_trainer(strategy, max_steps=steps, max_epochs=100).fit(module)
    return strategy


# -- (c) augmentation multiplicity: views of one example may mix, examples may not ---------------------------
class Jittered(Dataset):
    """Each call draws a new view (a random shift of the input)."""

    def __init__(self, x: Tensor, y: Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i] + 0.1 * torch.randn(self.x.shape[1]), self.y[i]


class Cycled(Dataset):
    """Example i's j-th call returns x_i + o_{j mod K}: K fixed views, any K consecutive calls give all."""

    def __init__(self, x: Tensor, y: Tensor, views: int) -> None:
        self.x, self.y, self.calls = x, y, [0] * len(x)
        self.offsets = torch.randn(views, x.shape[1], generator=torch.Generator().manual_seed(2)) * 1e2

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        self.calls[i] += 1
        return self.x[i] + self.offsets[self.calls[i] % len(self.offsets)], self.y[i]


class Augmented(TinyModule):
    """K views per example as consecutive rows; ``across=False``: a consistency loss between one example's
    views; ``across=True``: the same plus a batch-mean centring of the outputs (mixes examples)."""

    def __init__(self, views: int, across: bool, **kwargs) -> None:
        super().__init__(**kwargs)
        self.views, self.across = views, across

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Jittered(self.x, self.y), batch_size=self.batch_size)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if not checking():
            self.seen_batch_sizes.append(len(x))
        out = self(x)
        if self.across:
            out = out - 0.5 * out.mean(0)
        grouped = out.view(-1, self.views, out.shape[1])
        consistency = (grouped - grouped.mean(1, keepdim=True)).square().sum(2).mean()
        return F.cross_entropy(out, y) + consistency


@pytest.mark.parametrize("batch_size", [4, 128])
def test_a_consistency_loss_between_an_examples_views_trains_and_a_batch_statistic_is_refused(batch_size):
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, augmentation_multiplicity=4)
    make_trainer(strategy, max_steps=3, max_epochs=10).fit(
        Augmented(4, across=False, n=256, batch_size=batch_size)
    )
    assert strategy.engine.steps == 3
    assert strategy.checks.mixing.checked_steps[:1] == [0]
    trainer = make_trainer(DPStrategy(noise_multiplier=1.0, seed=0, augmentation_multiplicity=4), max_steps=1)
    with pytest.raises(DPConfigurationError, match="Sensitivity check failed") as refusal:
        trainer.fit(Augmented(4, across=True, n=256, batch_size=batch_size))
    assert "with all their augmented views" in str(refusal.value)


class JitteredUsers(UserData):
    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, Tensor]:
        return self.x[i] + 0.1 * torch.randn(self.x.shape[1]), self.y[i], self.users[i]


class AugmentedUsers(UserModule):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(JitteredUsers(self.x, self.y, self.users), batch_size=self.batch_size)


def test_users_with_augmented_views_are_compared_as_users():
    """Users and augmentation multiplicity together: a unit is a user's examples × K views."""
    strategy = fit_users(
        AugmentedUsers("user_contrastive", users=40), 8, steps=2, augmentation_multiplicity=2
    )
    assert strategy.checks.mixing.checked_steps[:1] == [0]
    with pytest.raises(DPConfigurationError, match="mixes users"):
        fit_users(AugmentedUsers("batch_centred", users=40), 8, steps=1, augmentation_multiplicity=2)
    isolated = fit_users(AugmentedUsers("batch_centred", users=40), 8, steps=2, augmentation_multiplicity=2,
                         isolate_examples=True)  # fmt: skip
    assert isolated.engine.steps == 2


# -- (d) isolate_examples isolates units -----------------------------------------------------------------------
class BatchMeanForward(UserModule):
    """A forward that centres its inputs on the mean of the rows it is given: across the batch unless each
    unit runs alone."""

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x - x.mean(0))


def test_isolate_examples_runs_each_user_alone_so_a_batch_mixing_model_is_per_user(monkeypatch):
    seen: list[int] = []
    module = BatchMeanForward("user_centred", users=24)
    strategy = users_dp(8, isolate_examples=True)
    step = BatchMeanForward.training_step

    def recording(self, batch, batch_idx):
        seen.append(len(torch.unique(batch[2])))
        return step(self, batch, batch_idx)

    monkeypatch.setattr(BatchMeanForward, "training_step", recording)
    make_trainer(strategy, max_steps=3, max_epochs=100).fit(module)
    assert strategy.engine.steps == 3
    assert seen
    assert set(seen) == {1}  # every call holds exactly one user's rows
    monkeypatch.undo()
    c = 1e-3
    move, _ = user_neighbour_move(
        BatchMeanForward("user_centred", users=12),
        lambda users: users_dp(users, noise_multiplier=0.0, max_grad_norm=c, isolate_examples=True),
    )
    assert c * (1 - 1e-3) <= move <= c * (1 + 1e-4)  # the removed user's clipped gradient, exactly C
    with pytest.raises(DPConfigurationError, match="Sensitivity check failed"):  # not isolated: it mixes
        fit_users(BatchMeanForward("user_centred", users=24), users_per_step=8, steps=1)


class CentredViews(Augmented):
    def forward(self, x: Tensor) -> Tensor:
        return self.net(x - x.mean(0))


def test_isolate_examples_runs_each_example_alone_with_all_its_views():
    module = CentredViews(4, across=False, n=64, batch_size=16)
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, augmentation_multiplicity=4, isolate_examples=True)
    make_trainer(strategy, max_steps=3).fit(module)
    assert strategy.engine.steps == 3
    assert set(module.seen_batch_sizes) == {4}  # one example's 4 views per call
    c = 1e-3
    data = Cycled(module.x[:8] * 1e3, module.y[:8], views=4)

    template = CentredViews(4, across=False, n=8)

    def step_sum(dataset) -> list[Tensor]:
        capture = released_sum(template, dataset, lambda: DPStrategy(
            noise_multiplier=0.0, max_grad_norm=c, augmentation_multiplicity=4, isolate_examples=True, seed=0
        ))  # fmt: skip
        assert capture.sums is not None
        return capture.sums

    full, rest = step_sum(data), step_sum(Subset(data, range(7)))
    move = sum(float((a - b).square().sum()) for a, b in zip(full, rest, strict=True)) ** 0.5
    assert move <= c * (1 + 1e-4)
    with pytest.raises(DPConfigurationError, match="Sensitivity check failed"):
        make_trainer(DPStrategy(noise_multiplier=1.0, seed=0, augmentation_multiplicity=4), max_steps=1).fit(
            CentredViews(4, across=False, n=64, batch_size=16)
        )


def test_isolate_examples_refuses_a_unit_larger_than_max_physical_batch_size():
    with pytest.raises(DPConfigurationError, match="more than one physical chunk"):
        users_dp(8, isolate_examples=True, max_physical_batch_size=2)
    with pytest.raises(DPConfigurationError, match="max_physical_batch_size=2"):
        DPStrategy(augmentation_multiplicity=4, isolate_examples=True, max_physical_batch_size=2)
    users_dp(8, isolate_examples=True, max_physical_batch_size=PER_USER)  # a user fits: accepted
    with pytest.raises(DPConfigurationError, match="would group them again"):  # example-level: as before
        DPStrategy(isolate_examples=True, max_physical_batch_size=4)


# -- (e) the checks do not change a correct user-level run ---------------------------------------------------
def test_every_step_checks_leave_a_user_level_run_as_without_them():
    weights = []
    for setting in (False, True, "every_step"):
        seed_everything(0, verbose=False)
        module = copy.deepcopy(UserModule("user_contrastive", users=40))
        strategy = fit_users(module, users_per_step=8, steps=6, check_sensitivity=setting)
        if setting == "every_step":
            assert len(strategy.checks.mixing.checked_steps) >= 5  # every non-empty batch
        weights.append([p.detach().clone() for p in module.parameters()])
    for other in weights[1:]:
        for a, b in zip(weights[0], other, strict=True):
            assert torch.equal(a, b)
