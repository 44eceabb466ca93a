"""The leave-one-out sensitivity check at fit start, and the per-example token loss it points to."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyModule, make_trainer
from lightning.pytorch import seed_everything
from lightning.pytorch.loggers import CSVLogger
from neighbour import BatchStandardised, Mixup, TinyLM, token_data
from torch import nn
from torch.utils.data import DataLoader

from lightning_dp import DPIS, DPConfigurationError, DPStrategy, per_example_token_loss
from lightning_dp import sensitivity as sensitivity_module
from lightning_dp.sensitivity import relative_tolerance, spread_indices

REFUSED = "Sensitivity check failed"


class _TokenMeanLM(TinyLM):
    def __init__(self) -> None:
        super().__init__(token_mean=True)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(token_data(n=16), batch_size=4)


class _SumWithMean(TinyModule):
    """Returns the batch sum while the strategy is told 'mean': the library scales by the batch size."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y, reduction="sum")


class _Dropout(TinyModule):
    """A correct model with randomness, a logged metric and a buffer its forward updates."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.net = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, 3))
        self.register_buffer("forwards", torch.zeros(()))

    def forward(self, x):
        self.forwards += 1
        return self.net(x)


class _Manual(TinyModule):
    def __init__(self) -> None:
        super().__init__(n=64, batch_size=16)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(F.cross_entropy(self(batch[0]), batch[1]))
        opt.step()


@pytest.mark.parametrize("model", [_TokenMeanLM, Mixup, BatchStandardised, _SumWithMean])
def test_losses_and_forwards_that_mix_examples_are_refused_before_any_release(model):
    module = model()
    before = [p.detach().clone() for p in module.parameters()]
    strategy = DPStrategy(noise_multiplier=1.0, seed=0)
    with pytest.raises(DPConfigurationError, match=REFUSED) as refusal:
        make_trainer(strategy, max_steps=2).fit(module)
    message = str(refusal.value)
    for cause_and_fix in (
        "token-level mean",
        "per_example_token_loss",
        "mixup",
        "batch statistic",
        "check_sensitivity=False",
    ):
        assert cause_and_fix in message
    assert strategy.engine.steps == 0  # nothing released
    assert strategy.ledger.steps == 0  # nothing priced
    for a, b in zip(before, module.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_opt_out_trains_a_model_the_check_refuses():
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, check_sensitivity=False)
    make_trainer(strategy, max_steps=2).fit(Mixup(n=64, batch_size=16))
    assert strategy.engine.steps == 2


def test_the_per_example_token_loss_passes_the_check():
    class Fixed(_TokenMeanLM):
        def __init__(self) -> None:
            TinyLM.__init__(self, token_mean=False)

    strategy = DPStrategy(noise_multiplier=1.0, seed=0)
    make_trainer(strategy, max_steps=2).fit(Fixed())
    assert strategy.engine.steps == 2


def _fit_dropout(check: bool, tmp_path, **strategy_kwargs):
    seed_everything(0, verbose=False)
    module = _Dropout(n=64, batch_size=16)
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, check_sensitivity=check, **strategy_kwargs)
    logger = CSVLogger(tmp_path / ("on" if check else "off"), name="", version="")
    trainer = make_trainer(strategy, max_steps=3, logger=logger, log_every_n_steps=1)
    trainer.fit(module)
    return module, strategy


def test_a_correct_model_with_dropout_passes_and_the_check_leaves_no_trace(tmp_path, monkeypatch):
    """Same seeds with the check on and off: the same weights, buffers (bar the check's own forwards),
    ledger, noise stream, global RNG stream and logged metrics."""
    messages: list[str] = []
    monkeypatch.setattr(sensitivity_module, "rank_zero_info", messages.append)
    on_module, on = _fit_dropout(True, tmp_path)
    off_module, off = _fit_dropout(False, tmp_path)
    assert any("sensitivity check passed: 4 examples" in m for m in messages)
    for a, b in zip(on_module.parameters(), off_module.parameters(), strict=True):
        assert torch.equal(a, b)
    assert float(on_module.forwards) == float(off_module.forwards)  # the buffer was put back
    assert on.ledger.history == off.ledger.history
    assert torch.equal(on.engine.generator.get_state(), off.engine.generator.get_state())
    on_log = (tmp_path / "on" / "metrics.csv").read_text()
    assert on_log == (tmp_path / "off" / "metrics.csv").read_text()
    assert on_module.seen_batch_sizes[:4] == [4, 3, 4, 3]  # dropout draws random numbers: two trials


def test_a_refused_check_leaves_grads_and_rng_untouched(monkeypatch):
    """No .grad appears, and the global RNG is where it was, also when the check refuses."""
    seen = {}

    def spy(strategy):
        seen["rng"] = torch.get_rng_state()
        try:
            sensitivity_module.check_sensitivity(strategy)
        finally:
            seen["after"] = torch.get_rng_state()
            seen["grads"] = [p.grad for p in strategy.lightning_module.parameters()]

    monkeypatch.setattr("lightning_dp.strategies.base.check_sensitivity", spy)
    with pytest.raises(DPConfigurationError, match=REFUSED):
        make_trainer(DPStrategy(noise_multiplier=1.0, seed=0), max_steps=1).fit(Mixup(n=64, batch_size=16))
    assert torch.equal(seen["rng"], seen["after"])
    assert all(g is None for g in seen["grads"])


def test_manual_optimization_skips_the_check_and_says_so(monkeypatch):
    messages: list[str] = []
    monkeypatch.setattr(sensitivity_module, "rank_zero_info", messages.append)
    strategy = DPStrategy(noise_multiplier=1.0, seed=0)
    make_trainer(strategy, max_steps=2).fit(_Manual())
    assert strategy.engine.steps == 2
    assert any("sensitivity check skipped: manual optimization" in m for m in messages)


@pytest.mark.parametrize(("chunk", "refused"), [(3, True), (1, False)])
def test_virtual_batching_checks_within_a_physical_chunk(chunk, refused, monkeypatch):
    """Examples only meet inside a chunk: the check uses a chunk's size, and skips at one example."""
    messages: list[str] = []
    monkeypatch.setattr(sensitivity_module, "rank_zero_info", messages.append)
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, max_physical_batch_size=chunk)
    module = BatchStandardised(n=32, batch_size=8)
    if refused:
        with pytest.raises(DPConfigurationError, match=REFUSED):
            make_trainer(strategy, max_steps=1).fit(module)
    else:
        make_trainer(strategy, max_steps=1).fit(module)
        assert any("max_physical_batch_size=1" in m for m in messages)


def test_the_check_runs_under_bf16_mixed_and_with_dpis():
    strategy, module = DPStrategy(noise_multiplier=1.0, seed=0), TinyModule(n=64, batch_size=16)
    make_trainer(strategy, max_steps=1, precision="bf16-mixed").fit(module)
    assert strategy.engine.steps == 1
    assert module.seen_batch_sizes[:2] == [4, 3]  # nothing random: one trial, then the step
    assert len(module.seen_batch_sizes) == 3
    dpis = make_trainer(DPStrategy(sampler=DPIS(k=3, seed=0), noise_multiplier=1.0, seed=0), max_steps=1)
    with pytest.raises(DPConfigurationError, match=REFUSED):
        dpis.fit(Mixup(n=400, batch_size=10))


def test_tolerance_scales_with_the_compute_dtype():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert relative_tolerance("32-true", cpu) == sensitivity_module.RELATIVE_FLOOR
    assert relative_tolerance("bf16-mixed", cpu) == 16 * torch.finfo(torch.bfloat16).eps
    assert relative_tolerance("16-mixed", cpu) == 16 * torch.finfo(torch.float16).eps
    assert relative_tolerance("32-true", cuda) == 16 * 2.0**-10
    assert spread_indices(100, 4) == [0, 33, 66, 99]
    assert spread_indices(2, 4) == [0, 1]


# -- per_example_token_loss ------------------------------------------------------------------------------


def test_per_example_token_loss_is_each_examples_own_token_mean():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=g)
    labels = torch.randint(0, 7, (3, 5), generator=g)
    labels[0, 2:] = -100  # padding
    labels[2] = -100  # no labelled token at all
    losses = per_example_token_loss(logits, labels)
    assert losses.shape == (3,)
    torch.testing.assert_close(losses[0], F.cross_entropy(logits[0, :2], labels[0, :2]))
    torch.testing.assert_close(losses[1], F.cross_entropy(logits[1], labels[1]))
    assert losses[2] == 0
    custom = labels.masked_fill(labels == -100, 0)
    custom[0, 2:] = 0
    assert not torch.equal(per_example_token_loss(logits, custom, ignore_index=0), losses)


def test_per_example_token_loss_shifts_for_causal_models():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 6, 9, generator=g)
    tokens = torch.randint(0, 9, (2, 6), generator=g)
    shifted = per_example_token_loss(logits, tokens, shift=True)
    torch.testing.assert_close(shifted, per_example_token_loss(logits[:, :-1], tokens[:, 1:]))
    for i in range(2):
        assert math.isclose(
            float(shifted[i]), float(F.cross_entropy(logits[i, :-1], tokens[i, 1:])), rel_tol=1e-6
        )
    with pytest.raises(ValueError, match=r"logits \[B, T, V\]"):
        per_example_token_loss(logits[:, 0], tokens)


class _TwoDropouts(TinyModule):
    """Dropout after two layers: the second mask is drawn at an offset set by the batch size, so the
    leave-one-out passes differ even though no example is mixed. ``mix_in_train`` adds a batch mean to
    the hidden layer in train mode only: a real mixing the check must still find."""

    def __init__(self, mix_in_train: bool = False) -> None:
        super().__init__(n=64, batch_size=16)
        self.net = nn.Sequential(
            nn.Linear(10, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 16), nn.Tanh(), nn.Dropout(0.3)
        )
        self.head = nn.Linear(16, 3)
        self.mix_in_train = mix_in_train

    def forward(self, x):
        h = self.net(x)
        if self.mix_in_train and self.training:
            h = h + 0.5 * h.mean(0, keepdim=True)
        return self.head(h)


def test_dropout_after_the_first_layer_passes_and_train_only_mixing_is_still_refused(monkeypatch):
    """A correct model whose later dropout masks move with the batch size passes (checked in eval mode
    and by a same-shape swap in train mode); mixing that happens only in train mode is refused."""
    messages: list[str] = []
    monkeypatch.setattr(sensitivity_module, "rank_zero_info", messages.append)
    seed_everything(0, verbose=False)
    make_trainer(DPStrategy(noise_multiplier=1.0, seed=0), max_steps=1).fit(_TwoDropouts())
    assert any(
        "sensitivity check passed in eval mode, and in train mode with the last example swapped" in m
        for m in messages
    )
    seed_everything(0, verbose=False)
    with pytest.raises(DPConfigurationError, match=REFUSED):
        make_trainer(DPStrategy(noise_multiplier=1.0, seed=0), max_steps=1).fit(
            _TwoDropouts(mix_in_train=True)
        )
