"""A weight shared by an Embedding and a Linear (tied input and output embeddings): the joint kernel's
per-example norms and clipped sum against fp64 per-example gradients, with both the Gram route and the
per-example route for long sequences, padding rows, and crafted examples whose two parts cancel."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from lightning_dp.clipping.flat import clip_factors
from lightning_dp.per_example import GradientCapture
from lightning_dp.per_example.kernels import KernelCall, linear
from lightning_dp.per_example.kernels.tied import magnitude_gram, tied_sq_norms, tied_weighted
from lightning_dp.per_example.layer_calls import TiedCalls

V, D = 11, 6


class TiedLM(nn.Module):
    """wte → tanh → lm_head tied to wte; the loss is each example's own sum (a per-example loss)."""

    def __init__(self, padding_idx: int | None = None) -> None:
        super().__init__()
        self.wte = nn.Embedding(V, D, padding_idx=padding_idx)
        self.lm_head = nn.Linear(D, V, bias=False)
        self.lm_head.weight = self.wte.weight
        self.register_buffer("mix", torch.randn(V))

    def forward(self, idx: Tensor) -> Tensor:
        logits = self.lm_head(torch.tanh(self.wte(idx)))
        return (torch.log_softmax(logits, -1) * self.mix).sum()


@pytest.mark.parametrize("padding_idx", [None, 2])
@pytest.mark.parametrize("route", ["gram", "per-example"])
def test_tied_norms_and_sum_equal_fp64_autograd_per_example(
    route: str, padding_idx: int | None, monkeypatch
) -> None:
    torch.manual_seed(0)
    model = TiedLM(padding_idx).double()
    idx = torch.randint(0, V, (4, 5))
    idx[0, :2] = 2  # padding tokens (when padding_idx=2): no gradient to their row
    monkeypatch.setattr("lightning_dp.per_example.kernels.tied.use_gram", lambda *args: route == "gram")
    params = [model.wte.weight]
    expected = [torch.autograd.grad(model(idx[i : i + 1]), params) for i in range(4)]
    capture = GradientCapture(model, loss_reduction="sum")
    try:
        model(idx).backward()
        samples, _ = capture.collect()
        assert any(isinstance(r, TiedCalls) for r in samples._records)
        norms = samples.sq_norms()
        weights = torch.tensor([0.5, 1.0, 0.0, 2.0])
        sums = dict(zip(samples.params, samples.weighted_sum(weights), strict=True))
    finally:
        capture.remove()
    for i, grads in enumerate(expected):
        exact = sum(float(g.square().sum()) for g in grads)
        assert exact <= float(norms[i]) <= exact * (1 + 1e-3)
    expected_sum = sum(w * g[0] for w, g in zip(weights.double(), expected, strict=True))
    torch.testing.assert_close(sums[model.wte.weight].double(), expected_sum, rtol=1e-5, atol=1e-6)


def _exact(idx: Tensor, u: Tensor, a: Tensor, d: Tensor) -> Tensor:
    """‖E_i + L_i‖ per example in fp64."""
    out = []
    for i in range(idx.shape[0]):
        table = d[i].double().t() @ a[i].double()
        out.append(table.index_add_(0, idx[i], u[i].double()).norm())
    return torch.stack(out)


@pytest.mark.parametrize("route", ["gram", "per-example"])
def test_crafted_examples_whose_embedding_and_output_parts_cancel_contribute_at_most_c(
    route, monkeypatch
) -> None:
    """L_i = −E_i up to a tiny residual at a huge scale: ‖E‖² + ‖L‖² − 2|⟨E, L⟩| cancels in fp32, so the
    kernel must not understate; every example's released contribution stays ≤ C, rounding included."""
    monkeypatch.setattr("lightning_dp.per_example.kernels.tied.use_gram", lambda *args: route == "gram")
    monkeypatch.setattr(linear, "FOLD_FLOATS", 1)  # fold one example at a time
    emb, lin = nn.Embedding(V, D), nn.Linear(D, V, bias=False)
    lin.weight = emb.weight
    g = torch.Generator().manual_seed(3)
    T = 4
    idx = torch.randint(0, V, (3, T), generator=g)
    a = torch.randn(3, T, D, generator=g)
    d = torch.randn(3, T, V, generator=g)
    u = torch.randn(3, T, D, generator=g)
    # example 1: a_t = e_0, δ_t = −c·e_{k_t}, u_t = c(1 + ε)·e_0 with c = 2²⁴, ε = 2⁻²⁰: E + L = cε Σ_t e_{k_t}e_0ᵀ
    # (norm ≥ 16), but ‖E‖² + ‖L‖² + 2⟨E, L⟩ = c²N((1 + ε)² − 2(1 + ε) + 1) is exactly 0 in fp32
    c = 2.0**24
    a[1] = 0.0
    a[1, :, 0] = 1.0
    d[1] = 0.0
    d[1, torch.arange(T), idx[1]] = -c
    u[1] = 0.0
    u[1, :, 0] = c * (1 + 2.0**-20)
    embedding, output = KernelCall(emb, [idx], u), KernelCall(lin, [a], d)
    norms = tied_sq_norms(embedding, output)
    exact = _exact(idx, u, a, d)
    assert float(exact[1]) >= 16
    weights = clip_factors(norms.sqrt(), 1.0)
    assert bool((weights.double() * exact <= 1.0 + 1e-6).all()), (weights, exact, norms)
    for i in range(3):
        alone = torch.zeros(3)
        alone[i] = weights[i]
        released = tied_weighted(embedding, output, alone).double().norm()
        assert float(released) <= 1.0 + 1e-6


@pytest.mark.parametrize("V", [1, 63, 64, 200])
def test_the_block_magnitude_gram_bounds_the_magnitude_gram(V: int) -> None:
    """Σ_v |d_tv||d_sv| ≤ the block bound, for any width (a last, shorter block included)."""
    d = torch.randn(3, 5, V, generator=torch.Generator().manual_seed(V)) * 10.0 ** torch.randint(
        -3, 3, (3, 5, V)
    )
    exact = torch.einsum("btv,bsv->bts", d.double().abs(), d.double().abs())
    assert bool((magnitude_gram(d).double() >= exact).all())
    assert bool(
        (magnitude_gram(d, block=1).double() <= exact * (1 + 1e-4) + 1e-30).all()
    )  # blocks of 1: |d||d|ᵀ, rounded up
