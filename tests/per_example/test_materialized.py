"""Materialised per-example gradients (materialized.py): norms and weighted sums in fp32, any layout."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")


import torch
from tolerances import assert_close_scaled
from torch import nn

from lightning_dp.per_example.materialized import (
    materialized_sq_norm,
    materialized_sq_norms,
    materialized_weighted,
    materialized_weighted_grad,
)
from tests.per_example.kernel_cases import (
    assert_rel,
)


def test_materialized_fallback() -> None:
    p, q = nn.Parameter(torch.zeros(3, 2)), nn.Parameter(torch.zeros(4))
    g = {p: torch.randn(5, 3, 2, dtype=torch.float64), q: torch.randn(5, 4).bfloat16()}
    g[p][2] = float("nan")
    weights = torch.tensor([1.0, 0.5, 0.0, 2.0, 0.25])
    norms, sums = materialized_sq_norms(g), materialized_weighted_grad(g, weights)
    for param, samples in g.items():
        assert norms[param].dtype == torch.float32
        expected = samples.double().flatten(1).square().sum(1)
        torch.testing.assert_close(norms[param].double(), expected, rtol=1e-5, atol=0.0, equal_nan=True)
        keep = samples.double().clone()
        keep[2] = 0.0
        expected_sum = torch.einsum("i,i...->...", weights.double(), keep)
        assert_rel(sums[param], expected_sum, 1e-5)
    empty = materialized_sq_norms({p: torch.zeros(0, 3, 2)})
    assert empty[p].shape == (0,)


def test_materialized_reductions_read_permuted_layouts_in_place() -> None:
    """A per-example gradient stored channel-last and viewed in the weight's layout: same norms and
    sums as its contiguous copy, result contiguous in the weight's layout."""
    stored = torch.randn(5, 4, 3, 2, 6)  # [B, O, kh, kw, C]
    g = stored.permute(0, 1, 4, 2, 3)  # [B, O, C, kh, kw], not contiguous
    weights = torch.tensor([1.0, 0.0, 0.5, 2.0, 0.25])
    total = materialized_weighted(g, weights)
    assert total.shape == (4, 6, 3, 2)
    assert total.is_contiguous()
    assert_close_scaled(total, torch.tensordot(weights, g.contiguous(), dims=1), terms=5)
    assert_close_scaled(
        materialized_sq_norm(g), g.contiguous().flatten(1).square().sum(1), terms=g[0].numel()
    )
    assert materialized_sq_norm(torch.randn(3)).shape == (3,)
