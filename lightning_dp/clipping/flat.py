"""Flat L2 clipping (Abadi et al. 2016): scale each per-example gradient to norm at most C."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dp.per_example import PerExampleGradients
from lightning_dp.slots import Clipping, StepContext, sums_once


def per_sample_norms(grad_samples: PerExampleGradients) -> Tensor:
    """L2 norm of each example's whole gradient (all parameters), accumulated in fp32.

    On the fast path the norms come from each layer's inputs and output gradients directly.
    """
    return grad_samples.sq_norms().sqrt()


def margin_norms(norms: Tensor) -> Tensor:
    """The norms inflated by a relative 1e-5 (and 1e-6), so that fp32 rounding of the weighted sum can
    never push a contribution scaled by C/margin_norm above C (the sensitivity the ledger relies on)."""
    return norms * (1 + 1e-5) + 1e-6


def clip_factors(norms: Tensor, max_grad_norm: float) -> Tensor:
    """min(1, C/‖g_i‖), safe for zero norms; non-finite norms get factor 0 (the example is dropped).

    The norm is inflated (:func:`margin_norms`) so that fp32 rounding can never push a clipped
    contribution above C.
    """
    factors = (max_grad_norm / margin_norms(norms)).clamp(max=1.0)
    return torch.where(torch.isfinite(norms), factors, torch.zeros_like(factors))


def weighted_sum(grad_samples: PerExampleGradients, weights: Tensor) -> list[Tensor]:
    """Σ_i w_i g_i for every parameter, in fp32 (non-finite entries of dropped examples masked out)."""
    return grad_samples.weighted_sum(weights)


class FlatClipping(Clipping):
    """DP-SGD's clipping: every example's contribution has L2 norm ≤ ``max_grad_norm``."""

    @property
    def is_flat_l2(self) -> bool:
        # exactly this class: a subclass may change what clip_and_sum bounds
        return type(self) is FlatClipping

    @sums_once
    def clip_and_sum(self, grad_samples: PerExampleGradients, ctx: StepContext) -> list[Tensor]:
        norms = per_sample_norms(grad_samples)
        ctx.extras["per_sample_norms"] = norms
        return weighted_sum(grad_samples, clip_factors(norms, ctx.max_grad_norm))
