"""Per-example L1 clipping for Laplace noise (Kuru et al. 2020): ‖g_i‖₁ ≤ C, replace-one sensitivity 2C."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dp.clipping.flat import clip_factors, weighted_sum
from lightning_dp.per_example import PerExampleGradients
from lightning_dp.slots import Clipping, StepContext, sums_once


def per_sample_l1_norms(grad_samples: PerExampleGradients) -> Tensor:
    """L1 norm of each example's whole gradient (all parameters), in fp32."""
    tensors = grad_samples.materialize()
    batch = tensors[0].shape[0]
    return sum(
        (g.reshape(batch, -1).float().abs().sum(1) for g in tensors),
        torch.zeros(batch, device=tensors[0].device),
    )


class L1Clipping(Clipping):
    """Scale each per-example gradient to L1 norm at most ``max_grad_norm`` (the paper's C1, S1 = 2·C1).

    The sensitivity is for replace-one neighbours (the pure-DP model of the paper): replacing one
    example moves the clipped sum by at most 2C in L1.
    """

    mechanism = "laplace"
    refuses_user_level = "it bounds each example's L1 norm, not a user's"

    @sums_once
    def clip_and_sum(self, grad_samples: PerExampleGradients, ctx: StepContext) -> list[Tensor]:
        norms = per_sample_l1_norms(grad_samples)
        return weighted_sum(grad_samples, clip_factors(norms, ctx.max_grad_norm))

    def sensitivity(self, ctx: StepContext) -> float:
        return 2.0 * ctx.max_grad_norm
