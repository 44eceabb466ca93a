"""What the per-example capture computes exactly and what it refuses by name (issue #37, items 3, 4 and the
manual-optimization message), each through the Trainer with the default settings (checks on).

Exact means: the released clipped sum equals Σ_i clip_C(g_i) where g_i is autograd's gradient of example i
run alone (fp64, so any gap is the capture's, not rounding), and one example moves that sum by at most C
(``tests/neighbour.py``). Refused means: a ``DPConfigurationError`` that names the cause and the fix, before
any release (the ledger holds no event).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyModule, make_trainer
from lightning.pytorch import seed_everything
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from lightning_dp import DPConfigurationError, DPStrategy

N = 12
"""Examples per data set: the whole set is one batch (q = 1), so every example is in the released sum."""


def _clip(grads: list[Tensor], bound: float) -> list[Tensor]:
    norm = math.sqrt(sum(float(g.square().sum()) for g in grads))
    factor = min(1.0, bound / norm) if norm > 0 else 1.0
    return [g * factor for g in grads]


def assert_exact_clipped_sum(module: TinyModule, bound: float, neighbour: Any) -> None:
    """The first release's sum (σ = 0) equals Σ_i clip(g_i), each g_i from autograd on example i alone in
    fp64: with C = ∞ (the fidelity test: autograd's gradient) and with C = ``bound`` (per-example exactness,
    each norm counts); and removing one example moves the clipped sum by at most C."""
    module = module.double()
    if module.x.is_floating_point():
        module.x = module.x.double()
    dataset = TensorDataset(module.x[:N], module.y[:N])
    template = _copy(module)
    reference = _copy(template)
    reference.train()
    params = [p for p in reference.parameters() if p.requires_grad]
    alone = []
    for i in range(N):
        loss = reference.training_step((module.x[i : i + 1], module.y[i : i + 1]), 0)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        dense = [
            torch.zeros_like(p) if g is None else g.to_dense() for p, g in zip(params, grads, strict=True)
        ]
        alone.append(dense)  # a sparse embedding's gradient is sparse
    for clip_bound in (math.inf, bound):

        def strategy(clip_bound: float = clip_bound) -> DPStrategy:
            return DPStrategy(noise_multiplier=0.0, max_grad_norm=clip_bound, seed=0)

        got = neighbour.released_sum(template, dataset, strategy).sums
        clipped = [_clip(one, clip_bound) for one in alone]
        expected = [sum(parts) for parts in zip(*clipped, strict=True)]
        # The library clips and sums in fp32 (by design); the reference is fp64, so a gap is the capture's
        # or fp32 rounding of N terms, far below a dropped, doubled or misplaced term.
        total = sum(math.sqrt(sum(float(g.square().sum()) for g in one)) for one in clipped)
        atol = 16 * torch.finfo(torch.float32).eps * total
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e.double(), rtol=1e-4, atol=atol)

    def bounded() -> DPStrategy:
        return DPStrategy(noise_multiplier=0.0, max_grad_norm=bound, seed=0)

    neighbour.assert_neighbour_bound(neighbour.neighbour_move(template, dataset, bounded))


def _copy(module: TinyModule) -> TinyModule:
    import copy

    return copy.deepcopy(module)


def assert_refused_before_release(
    module: TinyModule, *phrases: str, max_steps: int = 3, released: int = 0
) -> str:
    """Fit with the defaults: a DPConfigurationError naming every phrase, after ``released`` releases."""
    strategy = DPStrategy(noise_multiplier=1.0, seed=0)
    with pytest.raises(DPConfigurationError) as refusal:
        make_trainer(strategy, max_steps=max_steps).fit(module)
    message = str(refusal.value)
    for phrase in phrases:
        assert phrase in message, message
    assert strategy.engine.ledger.steps == released
    return message


# -- models -------------------------------------------------------------------------------------------------


class Tokens(TinyModule):
    """Token sequences (4 per example, vocabulary 7, token 1 repeated in every sequence) and 7 classes."""

    def __init__(self) -> None:
        super().__init__(n=32, batch_size=8)
        g = torch.Generator().manual_seed(1)
        self.x = torch.randint(0, 7, (32, 4), generator=g)
        self.x[:, :2] = 1  # a token twice in every bag
        self.y = torch.randint(0, 7, (32,), generator=g)


class TiedProjection(Tokens):
    """``h @ emb.weight.T`` beside ``emb(idx)``: the projection is a functional use of the embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.ModuleDict({"emb": nn.Embedding(7, 5), "mix": nn.Linear(5, 5)})

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.net["mix"](self.net["emb"](x).mean(1)))
        return h @ self.net["emb"].weight.T


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(10, 3)
        self.temperature = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x)


class LossTemperature(TinyModule):
    """A temperature held by a head that is called, but read only in the loss."""

    def __init__(self) -> None:
        super().__init__(n=32, batch_size=8)
        self.net = Head()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x) / self.net.temperature, y)


class LateFunctionalUse(TinyModule):
    """Reads the last layer's bias in the loss from the third step on: after the first-batch check."""

    def __init__(self) -> None:
        super().__init__(n=64, batch_size=8)
        self.calls = 0

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if self.trainer.global_step >= 2:
            loss = loss + self.net[2].bias.square().sum()
        return loss


class _OldMatmul(torch.autograd.Function):
    """An old-style autograd.Function (``forward`` takes ``ctx``), which functorch cannot transform."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return x @ w.T

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        x, w = ctx.saved_tensors
        return grad @ w, grad.T @ x


class OldStyleLinear(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) * 0.3)

    def forward(self, x: Tensor) -> Tensor:
        return _OldMatmul.apply(x, self.weight)


class OldStyle(TinyModule):
    def __init__(self) -> None:
        super().__init__(n=32, batch_size=8)
        self.net = nn.Sequential(OldStyleLinear(10, 16), nn.Tanh(), nn.Linear(16, 3))


class Bags(Tokens):
    """``nn.EmbeddingBag`` over the token sequences: 2-D input (each row a bag) or flat tokens with offsets
    (and per-sample weights in sum mode); a token is repeated in every bag."""

    def __init__(self, mode: str, offsets: bool, padding_idx: int | None = None) -> None:
        super().__init__()
        self.net = nn.ModuleDict(
            {"bag": nn.EmbeddingBag(7, 5, mode=mode, padding_idx=padding_idx), "out": nn.Linear(5, 7)}
        )
        self.offsets = offsets

    def forward(self, x: Tensor) -> Tensor:
        bag = self.net["bag"]
        if not self.offsets:
            return self.net["out"](bag(x))
        starts = torch.arange(0, x.numel(), x.shape[1])
        if bag.mode == "sum":
            weights = 0.5 + x.reshape(-1).to(bag.weight.dtype) / 7  # each token's own weight
            return self.net["out"](bag(x.reshape(-1), starts, per_sample_weights=weights))
        return self.net["out"](bag(x.reshape(-1), offsets=starts))


class SparseEmbedding(Tokens):
    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.net = nn.ModuleDict({"emb": nn.Embedding(7, 5, sparse=True), "out": nn.Linear(5, 7)})
        self.optimizer = optimizer

    def forward(self, x: Tensor) -> Tensor:
        return self.net["out"](self.net["emb"](x).mean(1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "sparse_adam":
            return torch.optim.SparseAdam(list(self.parameters()))
        return torch.optim.SGD(self.parameters(), lr=0.1)


class PerRowLoop(TinyModule):
    """A layer called one row at a time, the rows concatenated: the head on ``h[i:i+1]`` (rows of a hidden
    state), or the first layer on ``x[i:i+1]`` (rows of the batch itself)."""

    def __init__(self, first: bool = False) -> None:
        super().__init__(n=32, batch_size=8)
        self.first = first

    def forward(self, x: Tensor) -> Tensor:
        if self.first:
            h = torch.cat([self.net[0](x[i : i + 1]) for i in range(len(x))])
            return self.net[2](torch.tanh(h))
        h = torch.tanh(self.net[0](x))
        return torch.cat([self.net[2](h[i : i + 1]) for i in range(len(h))])


class ReversedRows(TinyModule):
    """The head on the hidden rows in reverse order, one at a time, put back in order: rows are traced by
    index, never assumed to come in call order."""

    def __init__(self) -> None:
        super().__init__(n=32, batch_size=8)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.net[0](x))
        out = [self.net[2](h[i].unsqueeze(0)) for i in reversed(range(len(h)))]
        return torch.cat(out[::-1])


class LabelledHidden(TinyModule):
    """The head on the labelled rows of the hidden state only, the loss summed and divided by the batch size:
    the unlabelled examples contribute 0 to the head."""

    def __init__(self) -> None:
        super().__init__(n=32, batch_size=8)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        labelled = y != 0
        h = torch.tanh(self.net[0](x))
        return F.cross_entropy(self.net[2](h[labelled]), y[labelled], reduction="sum") / len(x)


class SetAttention(TinyModule):
    """A set transformer over the batch: attention across the batch's examples (``h.unsqueeze(0)``)."""

    def __init__(self) -> None:
        super().__init__(n=32, batch_size=8)
        self.inp = nn.Linear(10, 8)
        self.att = nn.MultiheadAttention(8, 2, batch_first=True)
        self.net = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x).unsqueeze(0)
        return self.net(self.att(h, h, h)[0][0])


class LabelledOnly(TinyModule):
    """The model runs on the labelled rows only (label ≠ 0), the loss summed and divided by the batch size."""

    def __init__(self) -> None:
        super().__init__(n=32, batch_size=8)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        labelled = y != 0
        return F.cross_entropy(self(x[labelled]), y[labelled], reduction="sum") / len(x)


# -- exact --------------------------------------------------------------------------------------------------


def test_an_old_style_autograd_function_in_a_layer_is_exact(neighbour):
    seed_everything(0, verbose=False)
    assert_exact_clipped_sum(OldStyle(), 0.05, neighbour)


@pytest.mark.parametrize(
    ("mode", "offsets", "padding_idx"),
    [
        ("mean", False, None),
        ("sum", True, None),
        ("max", False, None),
        ("mean", True, 3),
        ("max", True, None),
    ],
    ids=["mean-2d", "sum-offsets-weights", "max-2d", "mean-offsets-padding", "max-offsets"],
)
def test_embedding_bag_is_exact_with_repeated_tokens(mode, offsets, padding_idx, neighbour):
    seed_everything(0, verbose=False)
    assert_exact_clipped_sum(Bags(mode, offsets, padding_idx), 0.05, neighbour)


@pytest.mark.parametrize(
    "build",
    [PerRowLoop, lambda: PerRowLoop(first=True), ReversedRows, LabelledHidden, LabelledOnly],
    ids=["hidden-rows", "batch-rows", "reversed-rows", "labelled-hidden-rows", "labelled-input-rows"],
)
def test_a_layer_called_on_rows_of_the_batch_gives_each_row_to_its_example(build, neighbour):
    seed_everything(0, verbose=False)
    assert_exact_clipped_sum(build(), 0.05, neighbour)


def test_a_sparse_embedding_with_a_dense_optimizer_is_exact(neighbour):
    seed_everything(0, verbose=False)
    assert_exact_clipped_sum(SparseEmbedding("sgd"), 0.05, neighbour)


@pytest.mark.parametrize(
    "model", [TiedProjection, LossTemperature], ids=["tied-projection", "loss-temperature"]
)
def test_a_parameter_also_used_outside_its_module_has_every_use_in_its_per_example_gradient(model, neighbour):
    seed_everything(0, verbose=False)  # issue #46: these were refused; each use is traced to the examples
    assert_exact_clipped_sum(model(), 0.05, neighbour)


def test_a_functional_use_that_starts_after_the_first_batch_is_covered_from_its_first_step():
    strategy = DPStrategy(noise_multiplier=1.0, seed=0)
    make_trainer(strategy, max_steps=5).fit(LateFunctionalUse())
    assert strategy.engine.ledger.steps == 5


# -- refused by name, before any release -------------------------------------------------------------------


def test_sparse_adam_is_refused_up_front_with_the_fix():
    assert_refused_before_release(SparseEmbedding("sparse_adam"), "sparse=False", "dense optimizer")


def test_attention_across_the_batch_is_refused_not_broadcast():
    assert_refused_before_release(SetAttention(), "unsqueeze(0)")


class GAN(TinyModule):
    """A DP-GAN: the discriminator steps on the private batch, the generator through the discriminator on
    generated rows only. ``alternate``: one of the two per batch (what the refusal advises), else both."""

    def __init__(self, alternate: bool) -> None:
        super().__init__(n=32, batch_size=8)
        self.automatic_optimization = False
        self.net = nn.Sequential(nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, 1))
        self.generator = nn.Linear(4, 10)
        self.alternate = alternate

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, _ = batch
        opt_d, opt_g = self.optimizers()
        z = torch.randn(len(x), 4)
        if not self.alternate or batch_idx % 2 == 0:
            fake = self.generator(z).detach()
            real_loss = F.binary_cross_entropy_with_logits(self.net(x), torch.ones(len(x), 1))
            fake_loss = F.binary_cross_entropy_with_logits(self.net(fake), torch.zeros(len(x), 1))
            opt_d.zero_grad()
            self.manual_backward(real_loss + fake_loss)
            opt_d.step()
        if not self.alternate or batch_idx % 2 == 1:
            opt_g.zero_grad()
            self.manual_backward(
                F.binary_cross_entropy_with_logits(self.net(self.generator(z)), torch.ones(len(x), 1))
            )
            opt_g.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.SGD(self.net.parameters(), lr=0.1),
            torch.optim.SGD(self.generator.parameters(), lr=0.1),
        ]


def test_a_generator_step_on_the_same_batch_is_refused_with_what_makes_it_trainable():
    assert_refused_before_release(GAN(alternate=False), "DP-GAN", "alternate the two steps", released=1)


def test_the_alternating_gan_the_refusal_advises_trains_one_release_per_batch():
    strategy = DPStrategy(noise_multiplier=1.0, seed=0)
    module = GAN(alternate=True)
    before = module.generator.weight.detach().clone()
    make_trainer(strategy, max_steps=4).fit(module)
    assert strategy.engine.ledger.steps == 4
    assert not torch.equal(before, module.generator.weight)


class UntracedRows(TinyModule):
    """Rows taken through a reshape (``h[i].view(1, -1)``): which example a call holds is not traced."""

    def __init__(self) -> None:
        super().__init__(n=32, batch_size=8)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.net[0](x))
        return torch.cat([self.net[2](h[i].view(1, -1)) for i in range(len(h))])


def test_a_layer_called_on_rows_that_cannot_be_traced_is_refused_by_name_not_crashed():
    assert_refused_before_release(UntracedRows(), "parts of the batch", "fc(h)")
