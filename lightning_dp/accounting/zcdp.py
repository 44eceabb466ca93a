"""zCDP: the ``ZCDP(rho)`` event, the conversions between ρ and (ε, δ), and the ρ of any event.

* ``ZCDP(rho)``: any ρ-zCDP release (a Gaussian measurement of an L2-sensitivity-Δ sum with noise
  std Δ/√(2ρ)); ε(α) = α·ρ (Bun & Steinke 2016).
* :func:`epsilon_from_rho` / :func:`rho_from_epsilon`: ρ-zCDP to (ε, δ)-DP and back.

:func:`zcdp_rho` gives the zCDP parameter of an event (for the zCDP filter): a sub-sampled Gaussian is
charged as unsampled (sampling only adds privacy we do not claim); events that are not ρ-zCDP for a
finite ρ (e.g. the safe SVT bounds) return ``None``. The other events that price one release each
(``PureDP``, ``LaplaceMechanism``, ``NoisyMin``, the SVTs) are in ``pure_dp.py``, ``laplace_mechanism.py``,
``noisy_min.py`` and ``svt.py``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .arguments import _check_delta, _check_positive, _orders
from .events import Gaussian, PoissonGaussian, PrivacyEvent

__all__ = [
    "ZCDP",
    "ZCDPConversion",
    "epsilon_from_rho",
    "gaussian_std_for_rho",
    "rho_from_epsilon",
    "zcdp_rho",
]


ZCDPConversion = Literal["cks", "bun_steinke"]


def _cks_offset(alpha: float, big_l: float) -> float:
    """c(α) in ε = α·ρ + c(α): (L − ln α)/(α − 1) + ln(1 − 1/α) (Canonne, Kamath & Steinke 2020, Prop. 12)."""
    return (big_l - math.log(alpha)) / (alpha - 1.0) + math.log1p(-1.0 / alpha)


def _best_order(objective: Callable[[float], float], guess: float) -> float:
    """The order α > 1 minimising ``objective``, searched over ln(α − 1) from the Bun-Steinke optimum."""
    from scipy.optimize import minimize_scalar

    centre = math.log(guess - 1.0)
    result = minimize_scalar(
        lambda t: objective(1.0 + math.exp(t)),
        bounds=(centre - 12.0, centre + 12.0),
        method="bounded",
        options={"xatol": 1e-10},
    )
    best = 1.0 + math.exp(float(result.x))
    return best if objective(best) <= objective(guess) else guess


def epsilon_from_rho(rho: float, delta: float, conversion: ZCDPConversion = "cks") -> float:
    """ε of a ρ-zCDP mechanism at ``delta``.

    ``"cks"`` (default): min over α > 1 of α·ρ + (L − ln α)/(α − 1) + ln(1 − 1/α), L = ln(1/δ)
    (Canonne, Kamath & Steinke 2020, Prop. 12: the tight conversion of RDP at one order, the one
    Opacus and dp-accounting use for RDP); every α gives a valid bound, so the numerical minimum is
    one. ``"bun_steinke"``: ρ + 2√(ρ·L) (Bun & Steinke 2016, Prop. 1.3; DP-AGD Lemma 3.8), 5-30 %
    larger, kept for parity with papers that use it.
    """
    r = _check_positive("rho", rho, allow_zero=True)
    big_l = math.log(1.0 / _check_delta(delta))
    loose = r + 2.0 * math.sqrt(r * big_l)
    if conversion == "bun_steinke" or r == 0.0:
        return loose
    if conversion != "cks":
        raise ValueError(f"conversion must be 'cks' or 'bun_steinke', got {conversion!r}")
    alpha = _best_order(lambda a: a * r + _cks_offset(a, big_l), 1.0 + math.sqrt(big_l / r))
    return max(0.0, min(loose, alpha * r + _cks_offset(alpha, big_l)))


def rho_from_epsilon(epsilon: float, delta: float, conversion: ZCDPConversion = "cks") -> float:
    """The largest ρ whose :func:`epsilon_from_rho` (same ``conversion``) is at most ``epsilon``.

    ``"cks"``: max over α of (ε − c(α))/α, each a ρ whose bound at that α is exactly ε (rounded down
    until it is). ``"bun_steinke"``: (√(L + ε) − √L)², the closed form of DP-AGD eq. 5.
    """
    eps = _check_positive("epsilon", epsilon)
    big_l = math.log(1.0 / _check_delta(delta))
    # (√(L+ε) − √L)² = ε² / (√(L+ε) + √L)²: no cancellation for small ε.
    loose = eps**2 / (math.sqrt(big_l + eps) + math.sqrt(big_l)) ** 2
    if conversion == "bun_steinke":
        return loose
    if conversion != "cks":
        raise ValueError(f"conversion must be 'cks' or 'bun_steinke', got {conversion!r}")
    alpha = _best_order(lambda a: -(eps - _cks_offset(a, big_l)) / a, 1.0 + math.sqrt(big_l / loose))
    rho = max(loose, (eps - _cks_offset(alpha, big_l)) / alpha)
    # Round down until the reported ε (its own minimisation over α) is within the target too.
    while rho > loose and (
        alpha * rho + _cks_offset(alpha, big_l) > eps or epsilon_from_rho(rho, delta) > eps
    ):
        rho = max(loose, rho * (1.0 - 4 * sys.float_info.epsilon))
    return rho


def gaussian_std_for_rho(rho: float, sensitivity: float) -> float:
    """Noise std Δ/√(2ρ) that makes a Gaussian release of L2 sensitivity Δ exactly ρ-zCDP."""
    return _check_positive("sensitivity", sensitivity) / math.sqrt(2.0 * _check_positive("rho", rho))


@dataclass(frozen=True)
class ZCDP(PrivacyEvent, kind="zcdp"):
    """A ρ-zCDP release, e.g. a Gaussian measurement with noise std Δ/√(2ρ) (DP-AGD Lemma 3.6)."""

    rho: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "rho", _check_positive("rho", self.rho, allow_zero=True))

    def rdp(self, orders: tuple[float, ...]) -> np.ndarray:
        """ε(α) = α·ρ."""
        return _orders(orders) * self.rho

    def zcdp(self) -> float:
        return self.rho


def zcdp_rho(event: PrivacyEvent) -> float | None:
    """ρ such that ``event`` is ρ-zCDP, or ``None`` when no finite ρ is known.

    A (Poisson-sub-sampled) Gaussian with noise multiplier σ is charged 1/(2σ²): sub-sampling is
    ignored, which is valid (a mixture's Rényi divergence is at most its components') and is the
    conservative accounting the DP-AGD spec prescribes for mini-batches (§5.4).
    """
    if isinstance(event, Gaussian | PoissonGaussian):
        if isinstance(event, PoissonGaussian) and event.sample_rate == 0.0:
            return 0.0
        sigma = event.noise_multiplier
        return math.inf if sigma == 0 else 1.0 / (2.0 * sigma**2)
    method = getattr(event, "zcdp", None)
    if callable(method):
        value = method()
        return None if value is None else float(value)
    return None
