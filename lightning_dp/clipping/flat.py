"""Flat L2 clipping (Abadi et al. 2016): scale each per-example gradient to norm at most C."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_dp.per_example import PerExampleGradients
from lightning_dp.per_example.materialized import materialized_sq_norm, materialized_weighted
from lightning_dp.slots import Clipping, StepContext, sums_once


def per_sample_norms(grad_samples: Sequence[Tensor]) -> Tensor:
    """L2 norm of each example's whole gradient (all parameters), accumulated in fp32.

    On the fast path the norms come from each layer's inputs and output gradients directly.
    """
    if isinstance(grad_samples, PerExampleGradients):
        return grad_samples.sq_norms().sqrt()
    return sum(materialized_sq_norm(g) for g in grad_samples).sqrt()  # type: ignore[union-attr]


def clip_factors(norms: Tensor, max_grad_norm: float) -> Tensor:
    """min(1, C/‖g_i‖), safe for zero norms; non-finite norms get factor 0 (the example is dropped).

    The norm is inflated by a relative 1e-5 so that fp32 rounding can never push a clipped
    contribution above C (the sensitivity the ledger relies on).
    """
    factors = (max_grad_norm / (norms * (1 + 1e-5) + 1e-6)).clamp(max=1.0)
    return torch.where(torch.isfinite(norms), factors, torch.zeros_like(factors))


def weighted_sum(grad_samples: Sequence[Tensor], weights: Tensor) -> list[Tensor]:
    """Σ_i w_i g_i for every parameter, in fp32 (non-finite entries of dropped examples masked out)."""
    if isinstance(grad_samples, PerExampleGradients):
        return grad_samples.weighted_sum(weights)
    return [materialized_weighted(g, weights) for g in grad_samples]


class FlatClipping(Clipping):
    """DP-SGD's clipping: every example's contribution has L2 norm ≤ ``max_grad_norm``."""

    @sums_once
    def clip_and_sum(self, grad_samples: Sequence[Tensor], ctx: StepContext) -> list[Tensor]:
        norms = per_sample_norms(grad_samples)
        ctx.extras["per_sample_norms"] = norms
        return weighted_sum(grad_samples, clip_factors(norms, ctx.max_grad_norm))
