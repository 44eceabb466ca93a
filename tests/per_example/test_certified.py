"""Crafted inputs cannot beat the fast-path norms: every example's contribution stays ≤ C.

DP is a worst case over data sets, so the inputs here are adversarial: per-position output gradients
that cancel, huge and tiny magnitudes, mixed signs, long sequences. For every kernel family the
contribution w_i·g_i is measured exactly (fp64 per-example gradient by autograd, times the weight the
engine's clip_factors gives from the fast-path norm), and so is the fp32 clipped sum itself.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
from conftest import make_trainer
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy
from lightning_dp.clipping.adaclip import _linear_transformed_sq_norms
from lightning_dp.clipping.automatic import normalise_factors
from lightning_dp.clipping.flat import clip_factors
from lightning_dp.per_example.kernels import Cache, is_supported, linear, sq_norms, weighted_grad
from lightning_dp.per_example.kernels.conv_autotune import force_conv_method
from lightning_dp.per_example.kernels.conv_methods import CONV_METHODS, ConvMethod

C = 1.0
BOUND = C * (1 + 1e-6)
T = 16


def alternating(n: int) -> Tensor:
    """(+1, −1, +1, ...) of length n."""
    return torch.tensor([(-1.0) ** t for t in range(n)])


def cancelling_linear(d_in: int, d_out: int, n: int, scale: float) -> tuple[Tensor, Tensor]:
    """x_t = (1 ± 2⁻¹³)·1, δ_t = ±scale·1/8: the per-example gradient is scale·2⁻⁹·√(d_in·d_out)/8, but
    every fp32 Gram entry x_t·x_s drops the 2⁻²⁶ that carries it, so the fp32 Gram norm is exactly 0."""
    e = 2.0**-13 * alternating(n)
    x = (1 + e)[:, None] * torch.ones(d_in)
    d = alternating(n)[:, None] * torch.full((d_out,), scale / 8)
    return x.unsqueeze(0), d.unsqueeze(0)


def huge_pairs(n: int, width: int, seed: int) -> Tensor:
    """Output gradients [1, n, width] along n positions: ±2²⁴ pairs that cancel exactly, between small
    terms of magnitude 1e-3 to 1: an fp32 sum over the positions loses the small terms (2²⁴ has an ulp
    of 2), so a per-example gradient summed in fp32 understates the true one (fp64 keeps them)."""
    g = torch.Generator().manual_seed(seed)
    small = torch.randn(n, width, generator=g) * 10.0 ** torch.randint(-3, 1, (n, width), generator=g).float()
    out = small.abs()
    signs = torch.where(torch.rand(width, generator=g) < 0.5, -1.0, 1.0)
    out[0::4] = 2.0**24 * signs
    out[2::4] = -(2.0**24) * signs
    return out.unsqueeze(0)


def channels_first(t: Tensor) -> Tensor:
    """[B, L, C] -> [B, C, L] (contiguous)."""
    return t.transpose(1, 2).contiguous()


def exact_grads(layer: nn.Module, x: Tensor, d: Tensor) -> list[Tensor]:
    """Per-example gradients [B, *shape] in fp64 (one autograd call per example with output gradient d)."""
    layer64 = copy.deepcopy(layer).double()
    params = [p for p in layer64.parameters() if p.requires_grad]
    x64 = x.double() if x.is_floating_point() else x
    rows = []
    for i in range(x.shape[0]):
        out = layer64(x64[i : i + 1])
        rows.append(torch.autograd.grad(out, params, d[i : i + 1].double(), allow_unused=True))
    return [
        torch.stack([r[j] if r[j] is not None else torch.zeros_like(p) for r in rows])
        for j, p in enumerate(params)
    ]


Factors = Callable[[Tensor, float], Tensor]
BOUNDS: dict[str, Factors] = {
    "clip": clip_factors,
    "normalise": lambda norms, c: normalise_factors(norms, c, 0.0),  # AutoClipping at r = 0: every one at C
}
"""The per-example weights of the clippings that scale by C/‖g_i‖ (FlatClipping, QuantileClipping; AutoClipping)."""


def assert_bounded(
    layer: nn.Module, x: Tensor, d: Tensor, exact: bool = True, factors: Factors = clip_factors
) -> None:
    """Each example's exact contribution w_i·‖g_i‖ and the fp32 clipped sum of each example alone ≤ C.

    ``exact=False`` checks only the released sum: under TF32 the release is itself computed from inputs
    rounded to 10-bit mantissas, so the fp64 gradient of the unrounded inputs is not what is released."""
    cache: Cache = {}
    norms = sq_norms(layer, [x], d, cache)
    weights = factors(sum(norms.values()).sqrt(), C)
    if exact:
        grads = exact_grads(layer, x, d)
        true_norms = torch.stack([g.flatten(1).square().sum(1) for g in grads]).sum(0).sqrt()
        contribution = weights.double() * true_norms
        assert bool((contribution <= BOUND).all()), (contribution.max().item(), true_norms.max().item())
    for i in range(x.shape[0]):  # what one example adds to the released sum, rounding included
        alone = torch.zeros_like(weights)
        alone[i] = weights[i]
        sums = weighted_grad(layer, [x], d, alone, cache)
        released = sum(s.double().square().sum() for s in sums.values()) ** 0.5
        assert float(released) <= BOUND, (i, float(released))


def with_normal_examples(x: Tensor, d: Tensor, seed: int = 0) -> tuple[Tensor, Tensor]:
    """The crafted example between two ordinary ones (the fold then mixes them)."""
    g = torch.Generator().manual_seed(seed)
    if x.is_floating_point():
        xs = torch.cat([torch.randn(x.shape, generator=g), x, torch.randn(x.shape, generator=g)])
    else:
        xs = torch.cat([x, x, x])
    return xs, torch.cat([torch.randn(d.shape, generator=g), d, torch.randn(d.shape, generator=g)])


Family = Callable[[], tuple[nn.Module, Tensor, Tensor]]


def _linear(d_in: int, d_out: int, n: int, bias: bool = False) -> Family:
    return lambda: (nn.Linear(d_in, d_out, bias=bias), *cancelling_linear(d_in, d_out, n, 4096.0))


def _conv(method: ConvMethod) -> Family:
    """1×1 kernels over 6×6 pixels: the Linear construction with the pixels as positions."""

    def make() -> tuple[nn.Module, Tensor, Tensor]:
        x, d = cancelling_linear(8, 16, 36, 4096.0)
        return nn.Conv2d(8, 16, 1), channels_first(x).view(1, 8, 6, 6), channels_first(d).view(1, 16, 6, 6)

    return make


def _conv_pairs() -> tuple[nn.Module, Tensor, Tensor]:
    return nn.Conv1d(2, 3, 1), torch.ones(1, 2, T), channels_first(huge_pairs(T, 3, 2))


def conv_method(family: str) -> ConvMethod | None:
    """The convolution method a family's name ends with (None: the automatic choice)."""
    for method in sorted(CONV_METHODS, key=len, reverse=True):
        if family.startswith("conv-") and family.endswith(method):
            return method
    return None


FAMILIES: dict[str, Family] = {
    "linear-gram": _linear(64, 64, T),
    "linear-gram-long": _linear(512, 512, 128),
    "linear-materialise-bias": _linear(4, 3, T, bias=True),
    **{f"conv-{m}": _conv(m) for m in CONV_METHODS},
    "linear-bias-pairs": lambda: (nn.Linear(3, 2), torch.ones(1, T, 3), huge_pairs(T, 2, 1)),
    **{f"conv-pairs-{m}": _conv_pairs for m in CONV_METHODS},
    "embedding-gram-pairs": lambda: (nn.Embedding(5, 8), torch.full((1, 4), 2), huge_pairs(4, 8, 3)),
    "embedding-sparse-pairs": lambda: (nn.Embedding(5, 2), torch.full((1, T), 3), huge_pairs(T, 2, 4)),
    "layernorm-pairs": lambda: (
        nn.LayerNorm(4),
        torch.randn(1, 1, 4, generator=torch.Generator().manual_seed(0)).expand(1, T, 4),
        huge_pairs(T, 4, 5),
    ),
    "groupnorm-pairs": lambda: (
        nn.GroupNorm(2, 4),
        torch.randn(1, 4, 1, generator=torch.Generator().manual_seed(0)).expand(1, 4, T)
        + 0.1 * torch.arange(4.0).view(1, 4, 1),
        channels_first(huge_pairs(T, 4, 6)),
    ),
}


@pytest.mark.parametrize("bound", list(BOUNDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_crafted_examples_contribute_at_most_c(
    family: str, dtype: torch.dtype, bound: str, monkeypatch
) -> None:
    layer, x, d = FAMILIES[family]()
    if not is_supported(layer):
        pytest.fail(f"{family}: no fast kernels")
    monkeypatch.setattr(linear, "FOLD_FLOATS", d[:1].numel())  # the Linear sum folds one example at a time
    x, d = with_normal_examples(x, d)
    if dtype != torch.float32:
        x = x.to(dtype) if x.is_floating_point() else x
        d = d.to(dtype)
    with force_conv_method(conv_method(family)):
        assert_bounded(layer, x, d, factors=BOUNDS[bound])


def test_the_cancelling_gram_norm_is_zero_in_fp32() -> None:
    """The crafted Linear example does beat a plain fp32 Gram norm (what the guard exists for)."""
    x, d = cancelling_linear(64, 64, T, 4096.0)
    aa, dd = x @ x.transpose(1, 2), d @ d.transpose(1, 2)
    assert float((aa * dd).sum()) == 0.0
    assert float((d[0].double().T @ x[0].double()).norm()) == 64.0


def test_adaclip_expanded_norm_near_the_mean_is_guarded() -> None:
    """AdaCliP's fast-path transformed norm ‖(δxᵀ − a)/b‖² with g = δxᵀ ≈ a: the shared guard gives at
    least the exact value."""
    layer = nn.Linear(32, 16, bias=False)
    g = torch.Generator().manual_seed(0)
    x, d = torch.randn(3, 32, generator=g), torch.randn(3, 16, generator=g)
    shift = (d[1:2].T @ x[1:2]) * (1 + 1e-7)  # example 1 sits on the mean
    inv_scale = torch.rand(16, 32, generator=g) * 1e3 + 1
    got = _linear_transformed_sq_norms(layer, x, d, {layer.weight: 0}, [shift], [inv_scale])[layer.weight]
    exact = ((d.double()[:, :, None] * x.double()[:, None, :] - shift.double()) * inv_scale.double()).square()
    exact = exact.flatten(1).sum(1)
    assert bool((got.double() >= exact * (1 - 1e-6)).all()), (got, exact)


class CancellingSequenceModel(LightningModule):
    """One Linear on sequences whose loss gradient is the crafted δ of :func:`cancelling_linear`."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64, bias=False)
        self.x, self.r = cancelling_linear(64, 64, T, 4096.0)

    def training_step(self, batch, batch_idx):
        x, r = batch
        return (self.lin(x) * r).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.r), batch_size=1)


def test_crafted_example_is_clipped_in_a_real_private_step() -> None:
    """σ = 0, q = 1, one example: the update is the clipped sum itself. Before the guard the fp32 Gram
    norm of this example was 0, its weight 1, and the step moved the weights by its whole gradient,
    64·C (issue #17's example: 66.7·C); now by at most C."""
    model = CancellingSequenceModel()
    before = model.lin.weight.detach().clone()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*adds no noise.*")
        strategy = DPStrategy(noise_multiplier=0.0, max_grad_norm=C, grad_sample_mode="fast")
        make_trainer(strategy, max_steps=1).fit(model)
    step = (model.lin.weight.detach() - before).double().norm().item()
    assert 0.5 * C < step <= BOUND, step
