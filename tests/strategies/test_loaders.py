"""The private train loader (``strategies/loaders.py``): Lightning's batch hooks get the batch the user's
collate made, in every kind of private run.

User-level runs, augmentation multiplicity and DPIS send per-batch info (the privacy units, the sampler's
snapshot) from the loader to the step. That info is taken off the batch as the private loader yields it, so
``on_before_batch_transfer``, ``transfer_batch_to_device``, ``on_after_batch_transfer``, and the module's and
a Callback's ``on_train_batch_start`` and ``on_train_batch_end`` see the user's batch, never lightning-dp's
wrapper, while ``training_step`` still gets the units of exactly the batch it runs.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TinyModule, make_trainer
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPIS, DPStrategy, checking
from lightning_dp.core.batches import EmptyBatch

USERS, PER_USER = 16, 4
USER_OF_EXAMPLE = torch.arange(USERS).repeat_interleave(PER_USER)
USER_LEVEL = dict(privacy_unit="user", user_key=USER_OF_EXAMPLE, examples_per_user=PER_USER, users_per_step=6)

RUNS = {  # the strategy's privacy arguments (a fresh sampler slot for each run)
    "example-level": lambda: {},
    "dpis": lambda: dict(sampler=DPIS(k=2, seed=3)),
    "user-level": lambda: USER_LEVEL,
    "augmentation_multiplicity=2": lambda: dict(augmentation_multiplicity=2),
    "user-level, virtual batching": lambda: dict(USER_LEVEL, max_physical_batch_size=PER_USER * 2),
}


def _unpack(batch):
    """What a user's hook does with its batch: ``x, y, user = batch`` (each item carries its user id)."""
    if isinstance(batch, EmptyBatch):  # an empty Poisson batch reaches the hooks as EmptyBatch (documented)
        return None
    x, y, user = batch
    assert len(x) == len(y) == len(user)
    return user


class Hooked(TinyModule):
    """Items are (x, y, user id); every batch hook records the type of the batch it gets and unpacks it."""

    def __init__(self, record: bool = True, num_workers: int = 0) -> None:
        super().__init__(n=USERS * PER_USER, batch_size=24)
        self.record, self.num_workers = record, num_workers
        self.seen: list[tuple[str, type]] = []
        self.unit_checks = 0

    def _note(self, hook: str, batch) -> None:
        self.seen.append((hook, type(batch)))
        _unpack(batch)

    def train_dataloader(self):
        data = TensorDataset(self.x, self.y, USER_OF_EXAMPLE)
        return DataLoader(data, batch_size=self.batch_size, num_workers=self.num_workers)

    def training_step(self, batch, batch_idx):
        user = _unpack(batch)
        units = self.trainer.strategy.engine.units
        if units is not None and user is not None and not checking():
            # the units handed to this step are this batch's: rows of one unit share one item id (a user,
            # or one example's augmented views), and consecutive units are different items
            rows = units.unit_of_row.tolist()
            assert len(rows) == len(user)
            if units.views > 1:  # each example's views, consecutive
                assert units.rows_per_unit().tolist() == [units.views] * (len(rows) // units.views)
            else:  # each user's rows
                for r in range(1, len(rows)):
                    assert (rows[r] == rows[r - 1]) == (int(user[r]) == int(user[r - 1]))
            self.unit_checks += 1
        x, y, _ = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def on_before_batch_transfer(self, batch, dataloader_idx):
        if self.record:
            self._note("module.on_before_batch_transfer", batch)
        return batch

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        if self.record:
            self._note("module.transfer_batch_to_device", batch)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch, dataloader_idx):
        if self.record:
            self._note("module.on_after_batch_transfer", batch)
        return batch

    def on_train_batch_start(self, batch, batch_idx):
        if self.record:
            self._note("module.on_train_batch_start", batch)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.record:
            self._note("module.on_train_batch_end", batch)


class Recorder(Callback):
    def __init__(self, module: Hooked) -> None:
        self.module = module

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.module._note("callback.on_train_batch_start", batch)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.module._note("callback.on_train_batch_end", batch)


def _fit(kwargs: dict, record: bool):
    torch.manual_seed(0)  # the same initial weights in both runs
    module = Hooked(record)
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, seed=0, **kwargs)
    callbacks = [Recorder(module)] if record else []
    make_trainer(strategy, max_epochs=-1, max_steps=4, callbacks=callbacks).fit(module)
    return module, strategy


@pytest.mark.parametrize("run", list(RUNS))
def test_every_batch_hook_gets_the_users_batch(run):
    """Each hook sees the user's collated list (or an EmptyBatch), and the run trains exactly as without hooks:
    the same ε and the same weights bit for bit (the units still reach the step that runs their batch)."""
    hooked, strategy = _fit(RUNS[run](), record=True)
    hooks = {hook for hook, _ in hooked.seen}
    assert hooks == {
        f"{owner}.{name}"
        for owner, names in (
            ("module", ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")),
            ("module", ("on_train_batch_start", "on_train_batch_end")),
            ("callback", ("on_train_batch_start", "on_train_batch_end")),
        )
        for name in names
    }
    assert {kind for _, kind in hooked.seen} <= {list, EmptyBatch}, hooked.seen
    assert strategy.engine.steps == 4
    if "user" in run or "augmentation" in run:
        assert hooked.unit_checks > 0  # the step got units, aligned with its batch

    plain, plain_strategy = _fit(RUNS[run](), record=False)
    assert plain_strategy.epsilon == strategy.epsilon
    for a, b in zip(hooked.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)


class SkipsSecondBatch(Hooked):
    """Ends the first epoch at its second batch (``on_train_batch_start`` returns -1): Lightning has already
    prefetched that batch, and the next epoch must still hand each step its own batch's units."""

    def on_train_batch_start(self, batch, batch_idx):
        super().on_train_batch_start(batch, batch_idx)
        if self.current_epoch == 0 and batch_idx == 1:
            return -1
        return None


def test_a_skipped_batch_leaves_the_next_epoch_aligned():
    module = SkipsSecondBatch()
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, seed=0, **USER_LEVEL)
    make_trainer(strategy, max_epochs=2, callbacks=[Recorder(module)]).fit(module)
    assert {kind for _, kind in module.seen} <= {list, EmptyBatch}
    assert module.unit_checks >= 2  # steps of the second epoch checked their units against their batch
    assert strategy.engine.steps == 1 + module.trainer.num_training_batches


def test_batches_collated_in_a_worker_reach_the_hooks_unwrapped():
    """With a worker process the batch and its units cross a process boundary together; the hooks still get
    the user's batch and each step its own batch's units."""
    module = Hooked(num_workers=1)
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, seed=0, **USER_LEVEL)
    make_trainer(strategy, max_epochs=-1, max_steps=4, callbacks=[Recorder(module)]).fit(module)
    assert {kind for _, kind in module.seen} <= {list, EmptyBatch}
    assert len({hook for hook, _ in module.seen}) == 7
    assert module.unit_checks > 0
    assert strategy.engine.steps == 4


def test_user_level_resume_refusal_counts_users(tmp_path):
    """A resume with another users_per_step is refused in the ledger's unit: U users, not N examples."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_dp import DPConfigurationError

    saver = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    first = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, **USER_LEVEL)
    make_trainer(first, tmp_path, max_steps=2, callbacks=[saver], enable_checkpointing=True).fit(
        Hooked(False)
    )
    other = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, **dict(USER_LEVEL, users_per_step=8))
    with pytest.raises(DPConfigurationError) as refused:
        make_trainer(other, tmp_path, max_steps=4).fit(Hooked(False), ckpt_path=str(tmp_path / "last.ckpt"))
    message = str(refused.value)
    assert f"trained on U={USERS} users" in message
    assert f"this run has U={USERS} users" in message
    assert "users_per_step changed q" in message
    assert "N=" not in message
