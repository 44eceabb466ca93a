"""Automatic clipping (Bu, Wang, Zha & Karypis, NeurIPS 2023, AUTO-S; Yang et al. 2022, normalised SGD).

Each per-example gradient is normalised instead of clipped, C·g_i/(‖g_i‖ + r), with a small public stability
constant r: every contribution has norm below C, whatever the data, so the sensitivity is C and the ledger
entry is DP-SGD's. At the default C = 1 there is no norm to tune; the learning rate absorbs the scale C set
(DP-SGD with every example clipped moves by lr·C·g/‖g‖, as this does). r = 0 is AUTO-V (pure normalisation).
Spec: shared/specs/adaptive_clipping.md §2.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dp.clipping.flat import margin_norms, per_sample_norms, weighted_sum
from lightning_dp.core.validation import number
from lightning_dp.per_example import PerExampleGradients
from lightning_dp.slots import Clipping, StepContext, sums_once


def normalise_factors(norms: Tensor, max_grad_norm: float, stability: float) -> Tensor:
    """C/(‖g_i‖ + r), with the norm inflated as :func:`~lightning_dp.clipping.clip_factors` does so that fp32
    rounding cannot lift a contribution to C; non-finite norms get factor 0 (the example is dropped)."""
    factors = max_grad_norm / (margin_norms(norms) + stability)
    return torch.where(torch.isfinite(norms), factors, torch.zeros_like(factors))


class AutoClipping(Clipping):
    """Per-example normalisation C·g_i/(‖g_i‖ + r): sensitivity C (``max_grad_norm``, default 1), ε DP-SGD's.

    Args:
        stability: r, the paper's stability constant (0.01); in the gradient's units. 0 is AUTO-V.
    """

    needs_finite_clip = True  # each gradient is scaled to norm just below C

    def __init__(self, stability: float = 0.01) -> None:
        self.stability = float(number(stability, "stability", owner="AutoClipping", low=0))

    @sums_once
    def clip_and_sum(self, grad_samples: PerExampleGradients, ctx: StepContext) -> list[Tensor]:
        norms = per_sample_norms(grad_samples)
        ctx.extras["per_sample_norms"] = norms
        return weighted_sum(grad_samples, normalise_factors(norms, ctx.max_grad_norm, self.stability))
