"""Every trainable parameter is in the private gradient every step, and ordinary layers train exactly or
are refused with their cause (issue #29, items 1, 6 and 8).

Parameters that become trainable during training (Lightning's ``BackboneFinetuning``, ``requires_grad_``
by hand) are clipped and noised from that step on: the neighbour test at the unfreezing step (learning
rate 0, so both runs reach it with the same weights) bounds what the optimizer receives, backbone
included, by C.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyModule, make_trainer
from lightning.pytorch import Callback, LightningModule, seed_everything
from lightning.pytorch.callbacks import BackboneFinetuning
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import AdaCliP, DPConfigurationError, DPStrategy, Poisson


class Finetuned(LightningModule):
    """A backbone and a head; the optimizer starts with the head only (BackboneFinetuning's recipe)."""

    def __init__(self, n: int = 64, batch_size: int = 16, lr: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 3)
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 10, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)
        self.batch_size, self.lr = batch_size, lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(self.backbone(x)), y)

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size)


def _unfreeze_at_epoch_one() -> BackboneFinetuning:
    return BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=1.0, should_align=False)


class UnfreezeByHand(Callback):
    """``requires_grad_(True)`` on the backbone at epoch 1 and a new parameter group for it."""

    def setup(self, trainer, pl_module, stage):  # before configure_optimizers, as BackboneFinetuning does
        pl_module.backbone.requires_grad_(False)

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            pl_module.backbone.requires_grad_(True)
            trainer.optimizers[0].add_param_group({"params": list(pl_module.backbone.parameters())})


class GradientsAtEpochOne(Callback):
    """What the optimizer receives (``p.grad`` before its step) on the first step of epoch 1."""

    def __init__(self) -> None:
        self.grads: dict[str, Tensor] | None = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.current_epoch == 1 and self.grads is None:
            self.grads = {
                n: p.grad.detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None
            }


@pytest.mark.parametrize(
    "unfreeze", [_unfreeze_at_epoch_one, UnfreezeByHand], ids=["BackboneFinetuning", "by_hand"]
)
def test_parameters_unfrozen_during_training_get_the_noise(unfreeze):
    """Two noise seeds, the same batches: the backbone's weights differ once it is unfrozen (before the fix
    its raw gradient reached the optimizer, and both seeds gave bit-identical backbones)."""
    backbones = []
    for seed in (0, 1):
        module = Finetuned()
        start = [p.detach().clone() for p in module.backbone.parameters()]
        strategy = DPStrategy(noise_multiplier=1.0, sampler=Poisson(seed=3), seed=seed)
        make_trainer(strategy, max_epochs=2, callbacks=[unfreeze()]).fit(module)
        after = [p.detach().clone() for p in module.backbone.parameters()]
        assert any(not torch.equal(a, b) for a, b in zip(start, after, strict=True))  # it trained at epoch 1
        backbones.append(after)
    assert all(not torch.equal(a, b) for a, b in zip(*backbones, strict=True))


@pytest.mark.parametrize(
    "unfreeze", [_unfreeze_at_epoch_one, UnfreezeByHand], ids=["BackboneFinetuning", "by_hand"]
)
def test_one_example_moves_what_the_optimizer_gets_at_the_unfreezing_step_by_at_most_c(unfreeze):
    """σ = 0, C = 0.01, q = 1, lr = 0 (both runs reach epoch 1 with the same weights): the gradient the
    optimizer receives there, times the expected batch size, moves by at most C when one example goes."""
    c = 0.01
    released = []
    for n in (8, 7):
        seed_everything(0, verbose=False)
        module = Finetuned(n=8, batch_size=n, lr=0.0)
        module.x, module.y = module.x[:n], module.y[:n]
        spy = GradientsAtEpochOne()
        strategy = DPStrategy(noise_multiplier=0.0, max_grad_norm=c, seed=0)
        make_trainer(strategy, max_epochs=2, callbacks=[unfreeze(), spy]).fit(module)
        assert spy.grads is not None
        assert {n for n in spy.grads if n.startswith("backbone")}, "the backbone got no gradient"
        released.append({k: v * strategy.engine.sampler.expected_batch_size for k, v in spy.grads.items()})
    move = math.sqrt(sum(float((released[0][k] - released[1][k]).square().sum()) for k in released[0]))
    assert move <= c * (1 + 1e-3), f"one example moved the released gradient by {move / c:.3g}·C"


def test_a_slot_with_per_parameter_state_refuses_a_change_of_the_trainable_parameters():
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, clipping=AdaCliP())
    with pytest.raises(DPConfigurationError, match="keeps state per parameter"):
        make_trainer(strategy, max_epochs=2, callbacks=[_unfreeze_at_epoch_one()]).fit(Finetuned())
    assert strategy.engine.steps == 4  # epoch 0 trained; nothing released after the change


class FreezeByHand(Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            pl_module.backbone[0].requires_grad_(False)


def test_a_layer_the_user_freezes_stays_frozen():
    """The book-keeping that skips weight gradients restores exactly what it froze, not every parameter."""
    module = Finetuned()
    strategy = DPStrategy(noise_multiplier=1.0, seed=0)
    make_trainer(strategy, max_epochs=3, callbacks=[FreezeByHand()]).fit(module)
    layer = module.backbone[0]
    assert not any(p.requires_grad for p in layer.parameters())
    assert layer.weight not in strategy.engine.params if strategy.engine.grads else True


# -- exact gradients for ordinary layers --------------------------------------------------------------------


class _Fidelity(Callback):
    """The first private gradient (σ = 0, C = ∞), and the batch it came from."""

    def __init__(self) -> None:
        self.batch: Any = None
        self.grads: list[Tensor] | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.batch is None:
            self.batch = [t.clone() for t in batch]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.grads is None:
            self.grads = [p.grad.detach().clone() for p in pl_module.parameters() if p.requires_grad]


def assert_fidelity(build: Any, steps: int = 2, **strategy_kwargs: Any) -> DPStrategy:
    """σ = 0, C = ∞: the first gradient the optimizer gets is autograd's sum over the batch / (q·N)
    (``build()`` twice from the same seed: the trained module and the reference)."""
    seed_everything(0, verbose=False)
    module = build()
    seed_everything(0, verbose=False)
    reference_module = build()
    spy = _Fidelity()
    strategy = DPStrategy(noise_multiplier=0.0, max_grad_norm=math.inf, seed=0, **strategy_kwargs)
    make_trainer(strategy, max_steps=steps, callbacks=[spy]).fit(module)
    assert spy.grads is not None
    assert spy.batch is not None
    reference_module.train()
    loss = reference_module.training_step(spy.batch, 0)
    params = [p for p in reference_module.parameters() if p.requires_grad]
    expected = torch.autograd.grad(loss * len(spy.batch[0]), params, allow_unused=True)
    scale = strategy.engine.sampler.expected_batch_size
    for got, want in zip(spy.grads, expected, strict=True):
        want = torch.zeros_like(got) if want is None else want / scale
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    return strategy


class Aliased(TinyModule):
    """The same layers registered twice (``self.inp`` and ``self.net[0]``): hooked once, not counted twice."""

    def __init__(self) -> None:
        super().__init__(n=64, batch_size=16)
        self.inp, self.out = self.net[0], self.net[2]


class KeywordCall(TinyModule):
    def forward(self, x):
        return self.net[2](input=torch.tanh(self.net[0](input=x)))


class LoraLike(nn.Module):
    """Its own parameters through F.linear, plus a frozen nn.Linear child (a hand-written LoRA)."""

    def __init__(self, d_in: int, d_out: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out).requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, d_in) * 0.3)
        self.b = nn.Parameter(torch.randn(d_out, rank) * 0.3)

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + F.linear(F.linear(x, self.a), self.b)


class LoraModel(TinyModule):
    def __init__(self) -> None:
        super().__init__(n=64, batch_size=16)
        torch.manual_seed(0)
        self.net = nn.Sequential(LoraLike(10, 16), nn.Tanh(), LoraLike(16, 3))


class WeightNormModel(TinyModule):
    def __init__(self, parametrization: bool) -> None:
        super().__init__(n=64, batch_size=16)
        norm = nn.utils.parametrizations.weight_norm if parametrization else nn.utils.weight_norm
        torch.manual_seed(0)
        self.net = nn.Sequential(norm(nn.Linear(10, 16)), nn.Tanh(), nn.Linear(16, 3))


@pytest.mark.parametrize(
    "build",
    [Aliased, KeywordCall, LoraModel, lambda: WeightNormModel(True), lambda: WeightNormModel(False)],
    ids=["aliased_layers", "keyword_call", "lora_like_custom_layer", "weight_norm", "weight_norm_hooks"],
)
def test_ordinary_layers_train_with_autograds_gradient(build):
    strategy = assert_fidelity(build, steps=3)  # three steps: the book-keeping starts at the second
    assert strategy.engine.steps == 3


def test_spectral_norm_layers_get_each_examples_own_gradient(neighbour):
    for parametrization in (False, True):
        module = TinyModule(n=8, batch_size=8)
        norm = nn.utils.parametrizations.spectral_norm if parametrization else nn.utils.spectral_norm
        module.net = nn.Sequential(norm(nn.Linear(10, 16)), nn.Tanh(), nn.Linear(16, 3))
        move = neighbour.neighbour_move(
            module,
            TensorDataset(module.x[:8], module.y[:8]),
            lambda: DPStrategy(noise_multiplier=0.0, max_grad_norm=1e-3, seed=0),
        )
        neighbour.assert_neighbour_bound(move)


class LazyModel(TinyModule):
    def __init__(self, example: bool) -> None:
        super().__init__(n=64, batch_size=16)
        self.net = nn.Sequential(nn.LazyLinear(16), nn.Tanh(), nn.Linear(16, 3))
        if example:
            self.example_input_array = torch.zeros(2, 10)


def test_lazy_layers_are_initialised_from_the_example_input_or_refused_with_the_fix():
    strategy = DPStrategy(noise_multiplier=1.0, seed=0)
    make_trainer(strategy, max_steps=2).fit(LazyModel(example=True))
    assert strategy.engine.steps == 2
    with pytest.raises(DPConfigurationError, match="example_input_array"):
        make_trainer(DPStrategy(noise_multiplier=1.0, seed=0), max_steps=2).fit(LazyModel(example=False))


class FlattenedLookup(TinyModule):
    """``emb(tokens.view(-1)).view(B, T, D)``: the batch folded into the lookup's one dimension."""

    def __init__(self) -> None:
        super().__init__(n=32, batch_size=8)
        self.emb = nn.Embedding(11, 4)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(20, 3))
        self.x = torch.randint(0, 11, (32, 5))

    def forward(self, tokens):
        batch, length = tokens.shape
        return self.net(self.emb(tokens.reshape(-1)).view(batch, length, 4))


def test_a_lookup_on_the_flattened_batch_traces_each_row_to_its_example():
    # issue #46: refused before; the reshape is traced, each token's row goes to its example
    assert_fidelity(FlattenedLookup, steps=2)


class PositionsEqualToBatch(TinyModule):
    """nanoGPT's ``wpe(torch.arange(T))`` with T equal to the batch (q = 1, N = T)."""

    def __init__(self) -> None:
        super().__init__(n=6, batch_size=6)
        torch.manual_seed(0)
        self.wte, self.wpe = nn.Embedding(11, 8), nn.Embedding(6, 8)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(48, 3))
        g = torch.Generator().manual_seed(2)
        self.x = torch.randint(0, 11, (6, 6), generator=g)

    def forward(self, idx):
        return self.net(torch.tanh(self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))))


@pytest.mark.parametrize("check", [True, False])
def test_a_position_lookup_is_shared_even_when_its_length_equals_the_batch(check, neighbour):
    """Before, the 6 position rows were taken for the 6 examples: one example moved the sum by 4.16·C."""
    module = PositionsEqualToBatch()
    move = neighbour.neighbour_move(
        module,
        TensorDataset(module.x, module.y),
        lambda: DPStrategy(noise_multiplier=0.0, max_grad_norm=1e-3, seed=0, check_sensitivity=check),
    )
    neighbour.assert_neighbour_bound(move)
    assert_fidelity(PositionsEqualToBatch, steps=1, check_sensitivity=check)


class ReturnsDictWithoutLoss(TinyModule):
    def training_step(self, batch, batch_idx):
        x, _y = batch
        return {"logits": self(x)}


def test_a_step_returning_a_dict_without_loss_gets_lightnings_own_message():
    with pytest.raises(Exception, match="loss") as info:
        make_trainer(DPStrategy(noise_multiplier=1.0, seed=0), max_steps=1).fit(ReturnsDictWithoutLoss())
    assert not isinstance(info.value, KeyError)


class ManualHalves(TinyModule):
    def __init__(self) -> None:
        super().__init__(n=64, batch_size=16)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        opt.zero_grad()
        half = len(x) // 2
        for part in (slice(0, half), slice(half, None)):
            self.manual_backward(F.cross_entropy(self(x[part]), y[part]) / 2)
        opt.step()


def test_manual_accumulation_over_parts_of_a_batch_gets_its_own_message():
    with pytest.raises(DPConfigurationError, match="manual gradient accumulation") as info:
        make_trainer(DPStrategy(noise_multiplier=1.0, seed=0), max_steps=1).fit(ManualHalves())
    assert "sequence-first" not in str(info.value)


class AddForeignGroup(Callback):
    """Adds a parameter group holding a tensor that is not the module's, at epoch 1."""

    def __init__(self) -> None:
        self.extra = nn.Parameter(torch.zeros(3))

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            trainer.optimizers[0].add_param_group({"params": [self.extra]})


def test_a_parameter_group_added_later_with_a_foreign_tensor_is_refused_before_the_release():
    strategy = DPStrategy(noise_multiplier=1.0, seed=0)
    with pytest.raises(DPConfigurationError, match="not part of the LightningModule's layers"):
        make_trainer(strategy, max_epochs=2, callbacks=[AddForeignGroup()]).fit(Finetuned())
    assert strategy.engine.steps == 4
