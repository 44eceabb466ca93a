"""AdaCliP (Pichapati et al. 2019): coordinate-wise adaptive clipping in a whitened space.

Each per-example gradient is shifted by a private running mean ``a`` and scaled per coordinate by
``b = sqrt(s · Σs / γ)``, clipped to norm 1, summed and noised (the step's only release), then mapped
back: ``g̃ = a + b·R/B``. The mean and variance estimates are computed from ``R`` alone, so they are
post-processing and cost no privacy: the ledger records one subsampled Gaussian per step, exactly as
DP-SGD. Not Opacus's ``AdaClipDPOptimizer`` (that is quantile clipping, Andrew et al.).
Spec: shared/specs/adaclip.md §2.6 (the canonical algorithm implemented here).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_dp.clipping.flat import clip_factors, per_sample_norms, weighted_sum
from lightning_dp.slots import Clipping, StepContext

VarianceMode = Literal["per_example", "literal"]


def adaclip_scale(s: Sequence[Tensor], gamma: float = 1.0) -> list[Tensor]:
    """Theorem 1's optimal per-coordinate scale b = sqrt(s · S / γ), S = Σ over all coordinates of s."""
    total = sum(float(t.sum()) for t in s)
    return [torch.sqrt(t * total / gamma) for t in s]


class AdaCliP(Clipping):
    """Coordinate-wise adaptive clipping: sensitivity 1 in the transformed space, ε exactly DP-SGD's.

    Args:
        h2: upper clamp of each coordinate's variance sample (caps b ≤ sqrt(d·h2)); tune it.
        beta1, beta2: EMA factors of the mean and of the variance.
        h1: lower clamp of the variance sample (> 0).
        gamma: target E‖w‖² of the transformed gradient (scale knob of b).
        variance_mode: ``"per_example"`` estimates each example's variance (what Theorem 1 needs);
            ``"literal"`` is the paper's eq. 5, the variance of the batch mean.
        init_std: initial s (default sqrt(h1·h2), the paper's).
    """

    def __init__(
        self,
        h2: float,
        beta1: float = 0.99,
        beta2: float = 0.9,
        h1: float = 1e-12,
        gamma: float = 1.0,
        variance_mode: VarianceMode = "per_example",
        init_std: float | None = None,
    ) -> None:
        if not 0 < h1 <= h2:
            raise ValueError(f"AdaCliP needs 0 < h1 ≤ h2, got h1={h1}, h2={h2}.")
        if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
            raise ValueError(f"AdaCliP's beta1 and beta2 must be in [0, 1), got {beta1}, {beta2}.")
        if not gamma > 0:
            raise ValueError(f"AdaCliP's gamma must be > 0, got {gamma}.")
        if variance_mode not in ("per_example", "literal"):
            raise ValueError(f"variance_mode must be 'per_example' or 'literal', got {variance_mode!r}.")
        self.h1, self.h2, self.beta1, self.beta2, self.gamma = h1, h2, beta1, beta2, gamma
        self.variance_mode: VarianceMode = variance_mode
        self.init_std = init_std if init_std is not None else math.sqrt(h1 * h2)
        if not self.init_std > 0:
            raise ValueError(f"AdaCliP's init_std must be > 0, got {self.init_std}.")
        self.m: list[Tensor] = []
        self.s: list[Tensor] = []
        self._b: list[Tensor] = []

    def setup(self, params: Sequence[Tensor]) -> None:
        if self.m:  # restored from a checkpoint before the parameters were known
            self.m = [m.to(p.device) for m, p in zip(self.m, params, strict=True)]
            self.s = [s.to(p.device) for s, p in zip(self.s, params, strict=True)]
            return
        self.m = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in params]
        self.s = [torch.full(p.shape, self.init_std, dtype=torch.float32, device=p.device) for p in params]

    # -- the step ---------------------------------------------------------------------------------
    def clip_and_sum(self, grad_samples: Sequence[Tensor], ctx: StepContext) -> list[Tensor]:
        """Σ_k clip_1((g_k − a)/b): the transformed, clipped sum that the noise is added to."""
        self._b = adaclip_scale(self.s, self.gamma)
        transformed = [(g.float() - a) / b for g, a, b in zip(grad_samples, self.m, self._b, strict=True)]
        return weighted_sum(transformed, clip_factors(per_sample_norms(transformed), 1.0))

    def sensitivity(self, ctx: StepContext) -> float:
        return 1.0

    def finalize(self, noisy_sums: list[Tensor], ctx: StepContext) -> list[Tensor]:
        """g̃ = a + b·R/B, then update the mean and variance estimates from R (post-processing)."""
        batch, z = ctx.expected_batch_size, ctx.noise_multiplier
        divisor = batch if self.variance_mode == "per_example" else batch * batch
        grads = []
        for j, (r, a, b) in enumerate(zip(noisy_sums, self.m, self._b, strict=True)):
            g_tilde = a + b * r / batch
            v = (b.square() * (r.square() - z * z) / divisor).clamp(self.h1, self.h2)
            self.m[j] = self.beta1 * a + (1 - self.beta1) * g_tilde
            self.s[j] = torch.sqrt(self.beta2 * self.s[j].square() + (1 - self.beta2) * v)
            grads.append(g_tilde)
        return grads

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"m": [t.cpu() for t in self.m], "s": [t.cpu() for t in self.s]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        device = self.m[0].device if self.m else torch.device("cpu")
        self.m = [t.to(device) for t in state["m"]]
        self.s = [t.to(device) for t in state["s"]]
