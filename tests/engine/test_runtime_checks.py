"""Run-time checks of the proof's assumptions (issue #16): one train loader, the realised batch on
every layer's dimension 0, one noisy release per sampled batch, and a clean stop at the budget.

Each test trains through the Trainer and fails without its check: the run used to train with an ε
it did not have. The DDP agreement check runs in tests/ddp_worker.py (``unequal_ranks``).
"""

from __future__ import annotations

import pytest
import torch
from conftest import TinyModule, make_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPConfigurationError, DPStrategy, Poisson
from lightning_dp.accounting import compute_epsilon
from lightning_dp.per_example import BatchDimensionError


def fit(module: TinyModule, strategy: DPStrategy | None = None, **kwargs) -> DPStrategy:
    strategy = strategy if strategy is not None else DPStrategy(noise_multiplier=1.0, seed=0)
    make_trainer(strategy, **kwargs).fit(module)
    return strategy


def released(strategy: DPStrategy) -> int:
    """Events the ledger priced (its history is run-length merged)."""
    return sum(count for _, count in strategy.ledger.history)


# -- 1. one train loader ------------------------------------------------------------------------------
class TwoLoaders(TinyModule):
    """A small loader at q = 8/32 beside a large one at q = 8/256: their examples have different ε."""

    def __init__(self, as_list: bool = False) -> None:
        super().__init__(n=256, batch_size=8)
        self.as_list = as_list

    def train_dataloader(self):
        large = DataLoader(TensorDataset(self.x, self.y), batch_size=8)
        small = DataLoader(TensorDataset(self.x[:32], self.y[:32]), batch_size=8)
        return [large, small] if self.as_list else {"large": large, "small": small}

    def training_step(self, batch, batch_idx):
        parts = batch if self.as_list else list(batch.values())
        x = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        return nn.functional.cross_entropy(self(x), y)


@pytest.mark.parametrize("as_list", [False, True], ids=["dict", "list"])
def test_several_train_loaders_are_refused_before_training(as_list):
    strategy = DPStrategy(target_epsilon=1.0, seed=0)
    with pytest.raises(DPConfigurationError, match="returned several loaders") as info:
        fit(TwoLoaders(as_list), strategy, max_epochs=1)
    assert "ConcatDataset" in str(info.value)
    assert released(strategy) == strategy.engine.steps == 0


def test_one_loader_reloaded_every_epoch_is_not_mistaken_for_several():
    strategy = fit(TinyModule(n=64, batch_size=16), max_epochs=2, reload_dataloaders_every_n_epochs=1)
    assert strategy.engine.steps == 8


# -- 2. the realised batch on every layer's dimension 0 ----------------------------------------------------------
class TimeMajorTagger(TinyModule):
    """Tags each of T=3 positions; the model goes time-major, so the Linear sees [T, B, d]."""

    def __init__(self, steps: int = 3, transpose: bool = True) -> None:
        super().__init__(n=128, batch_size=16)
        self.x = torch.randn(128, steps, 10, generator=torch.Generator().manual_seed(1))
        self.y = torch.randint(0, 3, (128, steps), generator=torch.Generator().manual_seed(2))
        self.net = nn.Linear(10, 3)
        self.transpose = transpose

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.transpose:
            x, y = x.transpose(0, 1), y.transpose(0, 1)  # [T, B, d]: time-major from here on
        return nn.functional.cross_entropy(self(x).reshape(-1, 3), y.reshape(-1))


def test_time_major_layers_are_refused_before_the_first_release():
    strategy = DPStrategy(noise_multiplier=1.0, seed=0)
    with pytest.raises(
        BatchDimensionError, match=r"Layer 'net' \(Linear\) has (fewer|more) rows on its batch dimension"
    ) as info:
        fit(TimeMajorTagger(), strategy, max_steps=2)
    assert "batch_first=True" in str(info.value)
    assert released(strategy) == 0


def test_batch_first_tagger_trains():
    assert fit(TimeMajorTagger(transpose=False), max_steps=2).engine.steps == 2


class BroadcastPosition(TinyModule):
    """Position embeddings looked up with batch 1 and broadcast over the batch (as HF models do)."""

    def __init__(self) -> None:
        super().__init__(n=128, batch_size=16)
        self.position = nn.Embedding(1, 10)

    def forward(self, x):
        return self.net(x + self.position(torch.zeros(1, dtype=torch.long, device=x.device)))


def test_broadcast_batch_one_input_gets_each_examples_own_gradient():
    """Looked up with batch 1 and broadcast (2d4380a crashed inside the kernel): the lookup is expanded to
    the batch the sampler drew, so each example's gradient is its own slice, not the batch's sum."""
    module = BroadcastPosition()
    strategy = DPStrategy(noise_multiplier=0.0, max_grad_norm=1e6, seed=0, check_sensitivity=False)
    x, y = module.x[:16], module.y[:16]
    loss = torch.nn.functional.cross_entropy(module(x), y, reduction="sum")
    (expected,) = torch.autograd.grad(loss, module.position.weight)
    strategy.engine.attach(module)
    strategy.engine.begin_batch(16)  # as the strategy does for each drawn batch
    torch.nn.functional.cross_entropy(module(x), y, reduction="mean").backward()
    samples, batch = strategy.engine.grads.collect(expected=16)
    per_example = dict(zip(samples.params, samples.materialize(), strict=True))[module.position.weight]
    assert batch == 16
    assert per_example.shape == (16, 1, 10)
    torch.testing.assert_close(per_example.sum(0), expected, rtol=1e-5, atol=1e-6)
    one = torch.nn.functional.cross_entropy(module(x[:1]), y[:1], reduction="sum")
    torch.testing.assert_close(per_example[0], torch.autograd.grad(one, module.position.weight)[0])
    strategy.engine.detach()
    assert fit(BroadcastPosition(), max_steps=1).engine.steps == 1


class SequenceFirstLSTM(TinyModule):
    """nn.LSTM with PyTorch's default batch_first=False, fed [T, B, d] with T equal to the batch: the
    shapes alone look per-example, so only the layer's own setting shows the problem."""

    def __init__(self) -> None:
        super().__init__(n=64, batch_size=8)
        self.x = torch.randn(64, 8, 4, generator=torch.Generator().manual_seed(1))
        self.lstm = nn.LSTM(4, 6)
        self.net = nn.Linear(6, 3)

    def forward(self, x):
        out, _ = self.lstm(x.transpose(0, 1))
        return self.net(out[-1])


class MyLSTM(nn.LSTM):
    """A subclass may change forward, so it is not swapped for the exact sequence-first LSTM."""


def sequence_first_subclass() -> SequenceFirstLSTM:
    model = SequenceFirstLSTM()
    model.lstm = MyLSTM(4, 6)
    return model


def test_sequence_first_recurrent_layer_is_refused_at_fit_start_unless_swapped_exactly():
    model = sequence_first_subclass()
    strategy = DPStrategy(noise_multiplier=1.0, seed=0)
    with pytest.raises(BatchDimensionError, match=r"Layer 'lstm' \(MyLSTM\) is built with batch_first=False"):
        fit(model, strategy, max_steps=1)
    assert released(strategy) == 0
    # nn.LSTM itself is swapped in place for an exact layer that puts the batch first (tests/per_example/zoo.py).
    strategy = DPStrategy(noise_multiplier=1.0, seed=0)
    assert fit(SequenceFirstLSTM(), strategy, max_steps=1).engine.steps == 1


def test_virtual_batching_checks_each_chunk_and_trains():
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, max_physical_batch_size=5)
    assert fit(TinyModule(n=128, batch_size=32), strategy, max_steps=3).engine.steps == 3
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, max_physical_batch_size=5)
    with pytest.raises(
        BatchDimensionError, match=r"'net' \(Linear\) has (fewer|more) rows on its batch dimension"
    ):
        fit(TimeMajorTagger(), strategy, max_steps=1)


# -- 4. one noisy release per sampled batch ---------------------------------------------------------------------
class TwoOptimizers(TinyModule):
    """Manual optimization, one optimizer per layer. ``alternate``: one of them steps per batch (fine);
    else both step on every batch (two releases of one sampled batch)."""

    def __init__(self, alternate: bool, **kwargs) -> None:
        super().__init__(**kwargs)
        self.alternate = alternate
        self.automatic_optimization = False

    def configure_optimizers(self):
        return [
            torch.optim.SGD(self.net[0].parameters(), lr=0.1),
            torch.optim.SGD(self.net[2].parameters(), lr=0.1),
        ]

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen_batch_sizes.append(len(x))
        optimizers = self.optimizers()
        for i, opt in enumerate(optimizers):
            if self.alternate and i != batch_idx % 2:
                continue
            opt.zero_grad()
            self.manual_backward(nn.functional.cross_entropy(self(x), y))
            opt.step()


@pytest.mark.parametrize("target", [None, 5.0], ids=["sigma", "target"])
def test_two_releases_from_one_batch_are_refused(target):
    strategy = DPStrategy(noise_multiplier=2.0, target_epsilon=target, seed=0)
    with pytest.raises(
        DPConfigurationError, match="A second noisy gradient release from the same sampled batch"
    ) as info:
        fit(TwoOptimizers(alternate=False), strategy, max_steps=4)
    assert "one optimizer over all parameters" in str(info.value)
    assert released(strategy) == strategy.engine.steps == 1


def test_alternating_optimizers_release_once_per_batch_including_empty_ones():
    """q = 1/32 over 64 examples: some batches are empty, and their noise-only step is one release."""
    module = TwoOptimizers(alternate=True, n=64, batch_size=2)
    strategy = fit(module, DPStrategy(noise_multiplier=1.0, sampler=Poisson(seed=3), seed=0), max_epochs=1)
    assert 0 not in module.seen_batch_sizes  # module.training_step never sees an empty batch
    assert strategy.engine.steps == 32
    assert strategy.epsilon == pytest.approx(
        compute_epsilon(noise_multiplier=1.0, sample_rate=2 / 64, steps=32, delta=1e-5), rel=1e-9
    )


def test_a_step_forced_past_the_budget_releases_nothing_and_stops():
    """min_steps used to force a step the budget could not pay for ("should have stopped" crash)."""
    target = (
        compute_epsilon(noise_multiplier=1.0, sample_rate=16 / 128, steps=3, delta=1e-5) * 1.001
    )  # three steps fit, the fourth does not
    module = TinyModule(n=128, batch_size=16)
    strategy = DPStrategy(noise_multiplier=1.0, target_epsilon=target, seed=0)
    trainer = make_trainer(strategy, max_steps=6, min_steps=6)
    trainer.fit(module)
    assert released(strategy) == strategy.engine.steps == 3
    assert strategy.epsilon <= target
    assert trainer.should_stop


def test_resuming_a_spent_run_stops_cleanly_without_a_release(tmp_path):
    target = compute_epsilon(noise_multiplier=1.0, sample_rate=16 / 128, steps=3, delta=1e-5) * 1.001
    trainer = make_trainer(DPStrategy(noise_multiplier=1.0, target_epsilon=target, seed=0), max_epochs=1)
    trainer.fit(TinyModule(n=128, batch_size=16))
    trainer.save_checkpoint(tmp_path / "spent.ckpt")
    strategy = DPStrategy(noise_multiplier=1.0, target_epsilon=target, seed=0)
    make_trainer(strategy, max_epochs=3).fit(
        TinyModule(n=128, batch_size=16), ckpt_path=tmp_path / "spent.ckpt"
    )
    assert released(strategy) == strategy.engine.steps == 3
    assert strategy.epsilon <= target
