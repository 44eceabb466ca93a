"""The loss-probe contract: clipped per-example losses at candidate weights, with no side effects."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn

from lightning_dp import DPConfigurationError
from lightning_dp.steps.loss_queries import LossProbe, require_loss_probe


class Probed(LightningModule):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(dropout), nn.Tanh(), nn.Linear(8, 3))
        self.logged = 0

    def forward(self, x):
        return self.net(x)

    def log(self, *args, **kwargs):
        self.logged += 1

    def dp_per_sample_loss(self, batch):
        x, y = batch
        losses = nn.functional.cross_entropy(self(x), y, reduction="none")
        self.log("probe_loss", losses.mean())  # must be silenced by the probe
        return losses


def _batch(n: int = 20):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def test_missing_method_names_it():
    with pytest.raises(DPConfigurationError, match="dp_per_sample_loss"):
        require_loss_probe(nn.Linear(2, 2), "AdaptiveGD")
    with pytest.raises(DPConfigurationError, match="dp_per_sample_loss"):
        LossProbe(nn.Linear(2, 2), [], clip=1.0, algorithm="AdaptiveGD")


def test_losses_are_clipped_to_zero_and_c_obj():
    class Fixed(nn.Module):
        w = nn.Parameter(torch.zeros(1))

        def dp_per_sample_loss(self, batch):
            return batch + 0 * self.w

    probe = LossProbe(Fixed(), [Fixed.w], clip=3.0)
    losses = probe.clipped_losses(torch.tensor([0.5, 4.0, 2.9, -0.1]))
    assert losses.tolist() == pytest.approx([0.5, 3.0, 2.9, 0.0])
    assert float(losses.sum()) == pytest.approx(6.4)


def test_candidates_match_manual_evaluation_and_restore_everything():
    torch.manual_seed(1)
    module = Probed()
    params = list(module.parameters())
    before = [p.detach().clone() for p in params]
    direction = [torch.randn_like(p) for p in params]
    steps = [0.0, 0.1, 0.5, 2.0]
    batch = _batch()
    rng_before = torch.get_rng_state()
    opt = torch.optim.Adam(params, lr=0.1)
    params[0].grad = torch.ones_like(params[0])
    params[1].grad = torch.ones_like(params[1])
    opt.step()  # give the optimizer some state
    before = [p.detach().clone() for p in params]
    opt_state = {k: v.clone() for k, v in opt.state[params[0]].items()}
    probe = LossProbe(module, params, clip=1.5, chunk_size=7)
    with probe.preserved(opt):
        sums = probe.along(batch, direction, steps)
        params[0].add_(1.0)  # any change inside preserved() is undone
        opt.state[params[0]]["exp_avg"].add_(5.0)
    assert torch.equal(torch.get_rng_state(), rng_before)
    for p, w in zip(params, before, strict=True):
        assert torch.equal(p, w)
    for k, v in opt_state.items():
        assert torch.equal(opt.state[params[0]][k], v)
    assert sums.dtype == torch.float64
    assert sums.shape == (4,)
    for k, eta in enumerate(steps):
        with torch.no_grad():
            moved = [w - eta * d for w, d in zip(before, direction, strict=True)]
            logits = torch.func.functional_call(
                module.net,
                dict(zip([n for n, _ in module.net.named_parameters()], moved, strict=True)),
                (batch[0],),
            )
            manual = (
                nn.functional.cross_entropy(logits, batch[1], reduction="none").double().clamp(0, 1.5).sum()
            )
        assert float(sums[k]) == pytest.approx(float(manual), rel=1e-6)
    assert module.logged == 0  # the probe silenced self.log
    module.dp_per_sample_loss(batch)
    assert module.logged == 1  # ... and put it back


def test_dropout_candidates_share_forward_randomness():
    torch.manual_seed(2)
    module = Probed(dropout=0.5).train()
    params = list(module.parameters())
    zero = [torch.zeros_like(p) for p in params]
    sums = LossProbe(module, params, clip=10.0, chunk_size=6).along(_batch(), zero, [0.0, 0.3, 1.0])
    # with a zero direction every candidate is the same weights: identical sums only if the masks agree
    assert sums[0] == sums[1] == sums[2]
    again = LossProbe(module, params, clip=10.0, chunk_size=6).along(_batch(), zero, [0.0])
    assert again[0] == sums[0]  # and the global RNG was not advanced by the first probe


def test_empty_batch_gives_zero_scores():
    module = Probed()
    params = list(module.parameters())
    x, y = _batch(0)
    sums = LossProbe(module, params, clip=1.0).along(
        (x, y), [torch.zeros_like(p) for p in params], [0.0, 1.0]
    )
    assert sums.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_vectorized_and_looped_candidates_agree(dropout):
    torch.manual_seed(3)
    module = Probed(dropout=dropout).train()
    params = list(module.parameters())
    direction = [torch.randn_like(p) for p in params]
    steps = [0.0, 0.2, 0.7]
    fast_probe = LossProbe(module, params, clip=2.0, chunk_size=8)
    fast = fast_probe.along(_batch(), direction, steps)
    assert fast_probe.vectorize  # vmap ran the model (no fallback)
    slow_probe = LossProbe(module, params, clip=2.0, chunk_size=8, vectorize=False)
    slow = slow_probe.along(_batch(), direction, steps)
    if dropout == 0.0:  # same weights, same data: the batched forward computes the same numbers
        assert torch.allclose(fast, slow, rtol=1e-5)
    zero = [torch.zeros_like(p) for p in params]
    shared = LossProbe(module, params, clip=10.0, chunk_size=6).along(_batch(), zero, [0.0, 0.3, 1.0])
    assert shared[0] == shared[1] == shared[2]
