"""The exact (ε, δ) curve of the Gaussian mechanism (Balle & Wang 2018, Thm 8), and its inverse in μ.

A composition of unsampled Gaussian mechanisms with noise multipliers σ_i is exactly one Gaussian
mechanism with μ² = Σ 1/σ_i² (their privacy-loss distributions are Gaussian), so a history of q = 1
Gaussians has this exact ε under every accountant. Correlated noise without amplification (BLT) records
such a history; its ε is read here instead of composing thousands of discretised distributions.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import optimize, special

from .rdp import check_delta

__all__ = ["gaussian_delta", "gaussian_epsilon", "gaussian_mu"]


def gaussian_delta(mu: float, epsilon: float) -> float:
    """δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) of a Gaussian mechanism with sensitivity/σ = μ."""
    if mu == 0.0:
        return 0.0
    if math.isinf(mu):
        return 1.0
    a = float(special.ndtr(-epsilon / mu + mu / 2.0))
    b = math.exp(epsilon + float(special.log_ndtr(-epsilon / mu - mu / 2.0)))
    return max(0.0, a - b)


def gaussian_epsilon(mu: float, delta: float) -> float:
    """The smallest ε with δ(ε) ≤ ``delta`` for a Gaussian mechanism of parameter μ (exact, rounded up).

    0 for μ = 0 (no release), ``inf`` for μ = ∞ (σ = 0). The root is found to machine precision and then
    moved up until δ(ε) ≤ delta holds in floating point, so the value is never below the true ε.
    """
    delta = check_delta(delta)
    mu = float(mu)
    if not mu >= 0.0:
        raise ValueError(f"mu must be >= 0, got {mu!r}")
    if mu == 0.0 or gaussian_delta(mu, 0.0) <= delta:
        return 0.0
    if math.isinf(mu):
        return math.inf
    hi = max(1.0, mu * mu)
    while gaussian_delta(mu, hi) > delta:
        hi *= 2.0
    eps = float(optimize.brentq(lambda e: gaussian_delta(mu, e) - delta, 0.0, hi, xtol=1e-15, rtol=8.9e-16))
    while gaussian_delta(mu, eps) > delta:
        eps = float(np.nextafter(eps, math.inf))
    return eps


def gaussian_mu(epsilon: float, delta: float) -> float:
    """The largest μ whose Gaussian mechanism is (ε, δ)-DP (rounded down, so calibrated noise is never short)."""
    delta = check_delta(delta)
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"epsilon must be a finite number > 0, got {epsilon!r}")
    hi = 1.0
    while gaussian_delta(hi, epsilon) <= delta:
        hi *= 2.0
    mu = float(
        optimize.brentq(lambda m: gaussian_delta(m, epsilon) - delta, 0.0, hi, xtol=1e-15, rtol=8.9e-16)
    )
    while mu > 0 and gaussian_delta(mu, epsilon) > delta:
        mu = float(np.nextafter(mu, 0.0))
    return mu


def unsampled_epsilon(segments: list[tuple[float, float, int]], delta: float) -> float | None:
    """Exact ε of a history of ``(σ, q, count)`` segments that are all unsampled Gaussians (q = 1), else None.

    Their composition is one Gaussian with μ² = Σ count/σ², so the PRV and PLD accountants read it here
    exactly instead of composing discretised distributions (a BLT run records one distinct σ per step).
    """
    if not segments or any(q != 1.0 for _, q, _ in segments):
        return None
    if any(sigma == 0.0 for sigma, _, _ in segments):
        return math.inf
    return gaussian_epsilon(math.sqrt(math.fsum(n / (sigma * sigma) for sigma, _, n in segments)), delta)
