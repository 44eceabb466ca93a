"""CHEB (Chen & Lee 2022, Alg. 3), the angle EMA, the η0 reset and the clip shrink.

Post-processing of released values only: nothing here reads the data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor


def angle_degrees(a: Tensor, b: Tensor) -> float:
    """Angle between two flat vectors in degrees (90° if either is zero), computed in float64."""
    a64, b64 = a.detach().double().reshape(-1), b.detach().double().reshape(-1)
    na, nb = float(a64.norm()), float(b64.norm())
    if na == 0 or nb == 0:
        return 90.0
    cosine = max(-1.0, min(1.0, float(a64 @ b64) / (na * nb)))
    return math.degrees(math.acos(cosine))


@dataclass(frozen=True)
class ChebDecision:
    """CHEB's outcome: the new budgets, whether ρ_grad was raised, and the angle that decided it."""

    rho_grad: float
    eps_bt: float
    raised_rho: bool
    raised_search: bool
    theta: float


def cheb_decision(
    d: Tensor,
    d2: Tensor,
    *,
    theta_bar: float,
    rho_grad: float,
    eps_bt: float,
    xi: float,
    phi_max: float,
    phi_min: float,
) -> ChebDecision:
    """Alg. 3's angle test: a wide (or obtuse) angle → the gradient is noisy, raise ρ_grad by (1+ξ);
    a narrow angle → the search is noisy, raise ε_BT by (1+ξ); otherwise no change (ties: no change).
    The caller always averages the two directions afterwards."""
    theta = angle_degrees(d, d2)
    dot = float(d.detach().double().reshape(-1) @ d2.detach().double().reshape(-1))
    if dot < 0 or theta > phi_max * theta_bar:
        return ChebDecision(rho_grad * (1 + xi), eps_bt, True, False, theta)
    if theta < phi_min * theta_bar:
        return ChebDecision(rho_grad, eps_bt * (1 + xi), False, True, theta)
    return ChebDecision(rho_grad, eps_bt, False, False, theta)


def angle_ema(theta_bar: float, theta: float, psi: float) -> float:
    """Eq. (7): θ̄ ← ψ·θ̄ + (1−ψ)·θ_t."""
    return psi * theta_bar + (1 - psi) * theta


def reset_eta0(eta0: float, accepted: Sequence[float], varsigma: float, growth: bool = False) -> float:
    """Intelligent backtracking: η0 ← min(ς·max Ω, η0) (or ς·max Ω with ``growth``); Ω = ∅ keeps η0."""
    if not accepted:
        return eta0
    proposal = varsigma * max(accepted)
    return proposal if growth else min(proposal, eta0)


def shrink_clips(c_grad: float, c_obj: float, zeta: float) -> tuple[float, float]:
    """DP-BLSGD-AC, eq. (9): both thresholds × (1−ζ). Privacy-free: the noise scales with them."""
    return c_grad * (1 - zeta), c_obj * (1 - zeta)
