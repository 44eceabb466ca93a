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
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_dp.clipping.flat import clip_factors, weighted_sum
from lightning_dp.core.validation import number
from lightning_dp.per_example import PerExampleGradients
from lightning_dp.per_example.kernels.certified import certified_sq_norms, rounding_gamma
from lightning_dp.per_example.materialized import materialized_sq_norm
from lightning_dp.slots import Clipping, StepContext, sums_once

VarianceMode = Literal["per_example", "literal"]

SATURATED_FRACTION = math.erfc(1 / math.sqrt(2))
"""p = P(Z² > 1) ≈ 0.3173, Z standard normal: where the noise dominates the variance samples
b²(R² − σ²)/B (R ≈ σZ per coordinate), the share of them that the upper clamp h2 catches, the rest
falling to h1; so s² settles near p·h2 (spec §5.10)."""


def adaclip_scale(s: Sequence[Tensor], gamma: float = 1.0) -> list[Tensor]:
    """Theorem 1's optimal per-coordinate scale b = sqrt(s · S / γ), S = Σ over all coordinates of s."""
    total = sum(float(t.sum()) for t in s)
    return [torch.sqrt(t * total / gamma) for t in s]


def transformed_sq_norms(
    grad_samples: PerExampleGradients, shift: Sequence[Tensor], inv_scale: Sequence[Tensor]
) -> Tensor:
    """Each example's ‖(g_i − a)/b‖² over all parameters (fp32, [B]), given a and 1/b per parameter.

    On the fast path a Linear layer with one input vector per example never materialises its
    per-example gradient g_i = δ_i x_iᵀ: with P = 1/b² and Q = a/b²,
    ‖(g_i − a)/b‖² = Σ_jk δ_ij² P_jk x_ik² − 2 Σ_jk δ_ij Q_jk x_ik + Σ a²/b², i.e. two matrix products
    ``(δ²) @ P`` and ``δ @ Q`` contracted with x² and x. For sequence inputs the squared term couples
    positions (T² products of the full weight size), so those layers, and layers of other types,
    materialise their own per-example gradients only (one layer at a time). Parameters that received no
    gradient count as g_i = 0.
    """
    index = {p: j for j, p in enumerate(grad_samples.params)}
    total = torch.zeros(grad_samples.batch, dtype=torch.float32, device=grad_samples.params[0].device)
    seen: set[int] = set()
    for layer in grad_samples.layers():
        module = layer.module
        if type(module) is nn.Linear and math.prod(layer.inputs[0].shape[1:-1]) == 1:
            for p, value in _linear_transformed_sq_norms(
                module, layer.inputs[0], layer.output_grad(), index, shift, inv_scale
            ).items():
                seen.add(index[p])
                total.add_(value)
            continue
        for p, g in layer.samples().items():
            if p in index:
                j = index[p]
                seen.add(j)
                total.add_(_transformed_sq_norm(g, shift[j], inv_scale[j]))
    for j in set(range(len(grad_samples.params))) - seen:  # no gradient: (0 − a)/b for every example
        total.add_(float((shift[j].float() * inv_scale[j]).square().sum()))
    return total


def _transformed_sq_norm(g: Tensor, a: Tensor, inv_b: Tensor) -> Tensor:
    """‖(g_i − a)/b‖² per example of one materialised [B, *shape] per-example gradient."""
    return materialized_sq_norm((g.float() - a) * inv_b)


def _linear_transformed_sq_norms(
    layer: nn.Linear,
    x: Tensor,
    d: Tensor,
    index: dict[nn.Parameter, int],
    shift: Sequence[Tensor],
    inv_scale: Sequence[Tensor],
) -> dict[nn.Parameter, Tensor]:
    """‖(g_i − a)/b‖² of a Linear layer's weight and bias from its input x_i and output gradient δ_i."""
    batch = d.shape[0]
    out: dict[nn.Parameter, Tensor] = {}
    weight, bias = layer.weight, layer.bias
    assert isinstance(weight, nn.Parameter)
    if weight in index:
        j = index[weight]
        x2, d2 = x.float().reshape(batch, layer.in_features), d.float().reshape(batch, layer.out_features)
        norms, magnitude = _expanded_sq_norms(x2, d2, shift[j].float(), inv_scale[j].float())
        # The terms can be much larger than their sum (an example near the mean a): the shared guard
        # adds the fp32 rounding bound, or recomputes in fp64 the examples where it is not small, so an
        # underestimated norm never lets a clipped contribution exceed the sensitivity 1.
        # |cross| ≤ (square + const)/2 by Cauchy–Schwarz; products of length out + in, P and Q rounded.
        bound = 3 * rounding_gamma(layer.in_features + layer.out_features + 8) * magnitude
        f64 = torch.float64

        def exact(i: Tensor) -> Tensor:
            # The direct form in fp64, one example at a time: the expanded form cancels in fp64 too
            # (terms ~1e8, value ~1e-6 measured), so it cannot be the exact reference.
            a, inv_b = shift[j].to(f64), inv_scale[j].to(f64)
            rows = [((d2[k].to(f64)[:, None] * x2[k].to(f64)[None, :] - a) * inv_b).square().sum() for k in i]
            return torch.stack(rows) if rows else torch.zeros(0, dtype=f64, device=x2.device)

        out[weight] = certified_sq_norms(norms, bound, exact).clamp(min=0)
    if isinstance(bias, nn.Parameter) and bias in index:
        j = index[bias]
        out[bias] = _transformed_sq_norm(d.reshape(batch, layer.out_features), shift[j], inv_scale[j])
    return out


def _expanded_sq_norms(x: Tensor, d: Tensor, a: Tensor, inv_b: Tensor) -> tuple[Tensor, Tensor]:
    """‖(δ_i x_iᵀ − a)/b‖² = (δ_i²)ᵀP x_i² − 2 δ_iᵀQ x_i + Σ a²P (P = 1/b², Q = a·P), and the size of the
    terms (square + const), which bounds the rounding error of the result."""
    p_mat = inv_b.square()  # [out, in]
    square = ((d.square() @ p_mat) * x.square()).sum(1)
    cross = ((d @ (a * p_mat)) * x).sum(1)
    # one sum of out·in terms, the same for every example: in fp64 so its rounding is negligible
    const = (a.double().square() * p_mat.double()).sum().to(x.dtype)
    return square - 2 * cross + const, square + const


class AdaCliP(Clipping):
    """Coordinate-wise adaptive clipping: sensitivity 1 in the transformed space, ε exactly DP-SGD's.

    Args:
        h2: upper clamp of each coordinate's variance sample (caps b ≤ sqrt(d·h2)). Default:
            C²/(p·d), p = P(Z² > 1) ≈ 0.317 (C = ``max_grad_norm``, d = the number of trainable
            parameters). Where the noise dominates the variance samples (d·σ²/B well above 2, which is
            where these defaults sit), each sample lands above h2 with probability about p and near h1
            otherwise, so s² settles at p·h2 and b at sqrt(p·d·h2) = C: AdaCliP is then a centred DP-SGD
            with clip C, and a learning rate tuned for DP-SGD at C carries over. (h2 = C²/d, the old
            default, settled at b ≈ 0.55·C, a 0.55× step.) s starts at that level, C/sqrt(d), so step 0
            is that DP-SGD. Tune h2 on a log grid around the default, with the learning rate.
        beta1: EMA factor of the running mean of the gradient (default 0.99).
        beta2: EMA factor of the running variance (default 0.9).
        h1: lower clamp of the variance sample (> 0).
        gamma: target E‖w‖² of the transformed gradient (scale knob of b).
        variance_mode: ``"per_example"`` estimates each example's variance (what Theorem 1 needs);
            ``"literal"`` is the paper's eq. 5, the variance of the batch mean.
        init_std: initial s (default sqrt(h1·h2), the paper's, when h2 is given; sqrt(p·h2) = C/sqrt(d)
            when derived).
    """

    tracks_parameters = True  # per-coordinate running mean and scale
    refuses_user_level = "its per-coordinate transform is not defined on a user's grouped gradient yet"

    def __init__(
        self,
        h2: float | None = None,
        beta1: float = 0.99,
        beta2: float = 0.9,
        h1: float = 1e-12,
        gamma: float = 1.0,
        variance_mode: VarianceMode = "per_example",
        init_std: float | None = None,
    ) -> None:
        number(h2, "h2", owner="AdaCliP", low=0, low_open=True, optional=True)
        for name, value in (("h1", h1), ("gamma", gamma)):
            number(value, name, owner="AdaCliP", low=0, low_open=True)
        for name, value in (("beta1", beta1), ("beta2", beta2)):
            number(value, name, owner="AdaCliP", low=0, high=1, high_open=True)
        number(init_std, "init_std", owner="AdaCliP", low=0, low_open=True, optional=True)
        if h2 is not None and not 0 < h1 <= h2:
            raise ValueError(f"AdaCliP needs 0 < h1 ≤ h2, got h1={h1}, h2={h2}.")
        if variance_mode not in ("per_example", "literal"):
            raise ValueError(f"variance_mode must be 'per_example' or 'literal', got {variance_mode!r}.")
        self.h1, self.beta1, self.beta2, self.gamma = h1, beta1, beta2, gamma
        self.h2_arg, self.init_std_arg = h2, init_std
        self.variance_mode: VarianceMode = variance_mode
        self.h2 = h2 if h2 is not None else math.nan
        """The variance clamp in use: the argument, or C²/(p·d) once the first step knows C and d."""
        self.init_std = init_std if init_std is not None else math.sqrt(h1 * self.h2)
        """The initial s (NaN until the first step when it derives from h2 = C²/(p·d))."""
        self.m: list[Tensor] = []
        self.s: list[Tensor] = []
        self._b: list[Tensor] = []
        self._started = False

    def setup(self, params: Sequence[Tensor]) -> None:
        if self.m:  # restored from a checkpoint before the parameters were known
            self.m = [m.to(p.device) for m, p in zip(self.m, params, strict=True)]
            self.s = [s.to(p.device) for s, p in zip(self.s, params, strict=True)]
            return
        self.m = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in params]
        # With h2 derived from C (known at the first step), s_0 waits for it; else the paper's init now.
        self.s = [] if math.isnan(self.init_std) else [torch.full_like(m, self.init_std) for m in self.m]
        self._started = False

    def _start(self, max_grad_norm: float) -> None:
        """First step: fix h2 (C²/(p·d) unless given), say what it means for the step size, set s_0."""
        self._started = True
        d = sum(m.numel() for m in self.m)
        natural = max_grad_norm**2 / (SATURATED_FRACTION * max(d, 1))
        if self.h2_arg is None:
            self.h2 = max(natural, self.h1)
            self.init_std = (
                self.init_std_arg
                if self.init_std_arg is not None
                else math.sqrt(SATURATED_FRACTION * self.h2)
            )
        else:
            ratio = math.sqrt(self.h2 / natural) if natural > 0 else math.inf
            if not 1 / 3 <= ratio <= 3:  # a 3× different step size is no longer the tuned one
                warnings.warn(
                    f"AdaCliP(h2={self.h2:g}): where the noise dominates, the per-coordinate scale settles "
                    f"near sqrt(p·d·h2) = {math.sqrt(SATURATED_FRACTION * d * self.h2):.3g} (p = P(Z² > 1) "
                    f"≈ {SATURATED_FRACTION:.3f}, d = {d} parameters), {ratio:.3g}× the clip max_grad_norm = "
                    f"{max_grad_norm:g}: AdaCliP then behaves like a centred DP-SGD with that clip, so a "
                    f"learning rate tuned for DP-SGD at C moves {ratio:.3g}× as far. Use h2 ≈ C²/(p·d) = "
                    f"{natural:.3g} (the default when h2 is left out), or retune the learning rate with h2 "
                    "(docs/mechanisms.md, AdaCliP).",
                    stacklevel=3,
                )
        if not self.s:
            self.s = [torch.full_like(m, self.init_std) for m in self.m]

    # -- the step ---------------------------------------------------------------------------------
    @sums_once
    def clip_and_sum(self, grad_samples: PerExampleGradients, ctx: StepContext) -> list[Tensor]:
        """Σ_k clip_1((g_k − a)/b): the transformed, clipped sum that the noise is added to."""
        if not self._started:
            self._start(ctx.max_grad_norm)
        self._b = adaclip_scale(self.s, self.gamma)
        inv_b = [1.0 / b for b in self._b]
        factors = clip_factors(transformed_sq_norms(grad_samples, self.m, inv_b).sqrt(), 1.0)
        # Σ_i c_i (g_i − a)/b = (Σ_i c_i g_i − (Σ_i c_i)·a)/b: the ordinary weighted sum (fast path
        # included), shifted and scaled once.
        total = factors.sum()
        return [
            (s - total * a) * ib
            for s, a, ib in zip(weighted_sum(grad_samples, factors), self.m, inv_b, strict=True)
        ]

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
        return {"m": [t.cpu() for t in self.m], "s": [t.cpu() for t in self.s], "h2": self.h2}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        device = self.m[0].device if self.m else torch.device("cpu")
        self.m = [t.to(device) for t in state["m"]]
        self.s = [t.to(device) for t in state["s"]]
        self.h2 = float(state.get("h2", self.h2))
