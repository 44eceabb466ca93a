"""Flat L2 clipping (Abadi et al. 2016): scale each per-example gradient to norm at most C."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_dp.grad_sample import PerExampleGradients
from lightning_dp.slots import Clipping, StepContext


def per_sample_norms(grad_samples: Sequence[Tensor]) -> Tensor:
    """L2 norm of each example's whole gradient (all parameters), accumulated in fp32.

    On the fast path the norms come from each layer's inputs and output gradients directly.
    """
    if isinstance(grad_samples, PerExampleGradients):
        return grad_samples.sq_norms().sqrt()
    batch = grad_samples[0].shape[0]
    squares = torch.zeros(batch, dtype=torch.float32, device=grad_samples[0].device)
    for g in grad_samples:
        squares += torch.linalg.vector_norm(g.flatten(1), dim=1, dtype=torch.float32).square()
    return squares.sqrt()


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
    out = []
    for g in grad_samples:
        g32 = g.float()
        keep = weights != 0
        if not bool(keep.all()):
            g32 = torch.where(keep.view(-1, *([1] * (g32.dim() - 1))), g32, torch.zeros_like(g32))
        out.append(torch.einsum("i,i...->...", weights, g32))
    return out


class FlatClipping(Clipping):
    """DP-SGD's clipping: every example's contribution has L2 norm ≤ ``max_grad_norm``."""

    def clip_and_sum(self, grad_samples: Sequence[Tensor], ctx: StepContext) -> list[Tensor]:
        norms = per_sample_norms(grad_samples)
        ctx.extras["per_sample_norms"] = norms
        return weighted_sum(grad_samples, clip_factors(norms, ctx.max_grad_norm))
