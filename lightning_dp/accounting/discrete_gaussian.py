"""The ledger event of one secure step: a Poisson-subsampled sum of discrete Gaussian shares on an integer grid.

One rank's share is N_Z(0, σ₀²) per coordinate (Canonne, Kamath & Steinke 2020), (Δ²/2σ₀²)-zCDP for an
integer sum of L2 sensitivity Δ. W ranks add W shares: their sum is not a discrete Gaussian, and Kairouz,
Liu & Steinke 2021 (Thm 1, "The Distributed Discrete Gaussian Mechanism") bound it as ½ε²-concentrated DP
with ε = Δ/(√W·σ₀) + τ√d, τ = 10·Σ_{k=1}^{W−1} exp(−2π²σ₀²·k/(k+1)) (τ = 0 for one rank).

Sampling amplification: the exact subsampled-Gaussian series the ledger uses for DP-SGD is derived for
the continuous Gaussian mixture, so it is not reused as such. The step is priced at integer orders α ≥ 2 by
Zhu & Wang's (2019, Thm 6) Poisson-subsampled bound for any mechanism with this RDP curve, without its
factor 3, which symmetric noise does not need (:func:`~lightning_dp.accounting.amplification.amplify_general`
with ``symmetric=True``; the proof is in its docstring and in :func:`~lightning_dp.accounting.amplification.removal_gap`):
the discrete one is dominated. For one rank and no sampler error this is exactly the sampled Gaussian's
integer-order RDP; the ledger's DP-SGD value also uses fractional orders, so ε can come out a little higher.

The sampler's floating-point error enters as well: each drawn coordinate's pmf is within a factor e^{±η}
of the exact discrete Gaussian (``sampler_error``), which adds (2α−1)/(α−1)·η per coordinate a neighbour
can move, W·d of them, to the RDP of order α; the rest (its tail, probability β per coordinate) is a δ
term the report states beside the ledger's (:func:`sampler_delta`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from torch import Tensor

from .amplification import amplify_general
from .events import PrivacyEvent, _check_noise_multiplier, _check_sample_rate

__all__ = ["NORM_MARGIN", "IntegerGrid", "PoissonDiscreteGaussian", "distributed_tau", "sampler_delta"]


NORM_MARGIN = 1e-4
"""Relative room in Δ above C/γ for the arithmetic of the norms and the scaling (fp32: a few 1e-7, even
summed over 10⁹ coordinates); a scaled example found above C/γ·(1 + NORM_MARGIN/2) is refused, never
released (a second materialisation that differs from the first)."""


@dataclass
class IntegerGrid:
    """The grid: d coordinates, the clip bound at √d/(2s) grid units, the rounded sensitivity Δ."""

    rounding_slack: float
    dimension: int = 0
    _sizes: tuple[int, ...] = field(default=(), repr=False)

    def setup(self, params: Sequence[Tensor]) -> None:
        """d: the trainable coordinates (the model's architecture, public)."""
        self._sizes = tuple(p.numel() for p in params)
        self.dimension = sum(self._sizes)

    @property
    def unit(self) -> float:
        """C/γ: the clip bound in grid units, √d/(2s) (independent of C, so σ in grid units is too)."""
        return math.sqrt(max(self.dimension, 1)) / (2 * self.rounding_slack)

    @property
    def sensitivity(self) -> float:
        """Δ: the L2 norm bound of one example's rounded vector, C/γ·(1 + margin) + √d/2, in grid units."""
        return self.unit * (1 + NORM_MARGIN) + math.sqrt(max(self.dimension, 1)) / 2

    @property
    def max_coordinate(self) -> int:
        """The largest |coordinate| one example's rounded vector can have."""
        return math.floor(self.unit * (1 + NORM_MARGIN) + 0.5)

    def step(self, max_grad_norm: float) -> float:
        """γ for a clip bound C: gradient units per grid unit."""
        return max_grad_norm / self.unit


def distributed_tau(share_scale: float, ranks: int) -> float:
    """τ of Kairouz, Liu & Steinke 2021 Thm 1 for ``ranks`` shares of N_Z(0, share_scale²): 0 for one rank."""
    if ranks <= 1:
        return 0.0
    k = np.arange(1, ranks, dtype=np.float64)
    return float(10.0 * np.exp(-2.0 * math.pi**2 * share_scale**2 * k / (k + 1)).sum())


def sampler_delta(tail: float, coordinates: int, steps: int, epsilon: float) -> float:
    """δ the sampler's tail adds to a run of ``steps`` releases of ``coordinates`` drawn values each (W·d):
    (1 + e^ε)·steps·coordinates·tail (a mechanism within total variation τ of an (ε, δ)-DP one is
    (ε, δ + (1 + e^ε)τ)-DP)."""
    if steps == 0 or tail == 0.0:
        return 0.0
    return float((1.0 + math.exp(min(epsilon, 700.0))) * steps * coordinates * tail)


@dataclass(frozen=True)
class PoissonDiscreteGaussian(PrivacyEvent, kind="poisson_discrete_gaussian"):
    """One secure DP-SGD step: the Poisson-subsampled sum of ``ranks`` discrete Gaussian shares.

    ``noise_multiplier`` is σ relative to the integer sensitivity Δ (each share's σ₀ = σΔ/√W);
    ``share_scale`` is σ₀ in grid units (only τ reads it), ``dimension`` d the coordinates of the sum, and
    ``sampler_error`` η the sampler's pointwise log-ratio bound against the exact pmf.
    """

    noise_multiplier: float
    sample_rate: float
    ranks: int
    dimension: int
    share_scale: float
    sampler_error: float

    def __post_init__(self) -> None:
        """Validate and normalise, so equal events hash equal and survive a checkpoint as plain values."""
        object.__setattr__(self, "noise_multiplier", _check_noise_multiplier(self.noise_multiplier))
        object.__setattr__(self, "sample_rate", _check_sample_rate(self.sample_rate))
        for name in ("ranks", "dimension"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("share_scale", "sampler_error"):
            value = float(getattr(self, name))
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {getattr(self, name)!r}")
            object.__setattr__(self, name, value)

    def concentrated_epsilon(self) -> float:
        """ε of the ½ε²-concentrated DP of one unsampled step (Kairouz et al. 2021 Thm 1; 1/σ for one rank)."""
        if self.noise_multiplier == 0.0:
            return math.inf
        tau = distributed_tau(self.share_scale, self.ranks)
        return 1.0 / self.noise_multiplier + tau * math.sqrt(self.dimension)

    def base_rdp(self, orders: np.ndarray) -> np.ndarray:
        """RDP of one unsampled step at ``orders``: α·ε²/2 plus the sampler's (2α−1)/(α−1)·W·d·η."""
        alpha = np.asarray(orders, dtype=np.float64)
        eps = self.concentrated_epsilon()
        if math.isinf(eps):
            return np.full_like(alpha, math.inf)
        drift = (2 * alpha - 1) / (alpha - 1) * self.ranks * self.dimension * self.sampler_error
        out: np.ndarray = alpha * eps**2 / 2 + drift
        return out

    def rdp(self, orders: tuple[float, ...]) -> np.ndarray:
        """The Poisson-subsampled RDP of :meth:`base_rdp` for symmetric noise (inf at fractional orders)."""
        if self.noise_multiplier == 0.0 and self.sample_rate > 0:
            return np.full(len(orders), math.inf)
        return amplify_general(orders, self.base_rdp, self.sample_rate, symmetric=True)
