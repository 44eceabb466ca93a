"""zCDP and pure-DP privacy events for adaptive steps, with valid Rényi-DP curves.

Each event prices ONE release. Curves are upper bounds on the RDP ε(α) at every order; where
several valid bounds exist the minimum is used (the minimum of valid bounds is valid):

* ``ZCDP(rho)``: any ρ-zCDP release (a Gaussian measurement of an L2-sensitivity-Δ sum with noise
  std Δ/√(2ρ)); ε(α) = α·ρ (Bun & Steinke 2016).
* ``PureDP(epsilon)``: any ε-DP release; ε(α) = min(ε, α·ε²/2, RR(α, ε)) where RR is the RDP of
  randomised response, the worst ε-DP mechanism (Mironov 2017, Prop. 5 + Bun & Steinke Prop. 1.4).
* ``LaplaceMechanism(epsilon)``: Laplace noise of scale Δ/ε; its exact RDP (Mironov 2017, Prop. 6).
* ``NoisyMin(epsilon, noise)``: report-noisy-min over monotone scores of sensitivity Δ with
  exponential (default) or Laplace noise of scale Δ/ε (ε-DP), or Gumbel noise (the exponential
  mechanism, ε-bounded-range, hence ε²/8-zCDP, Cesar & Rogers 2021).
* ``LaplaceSVT`` / ``GaussianSVT``: one AboveThreshold run (cut-off 1) over at most ``max_queries``
  queries; ``accounting="safe"`` (default) adds the ln(k)/(α−1) term of Zhu & Wang 2020, ``"paper"``
  is the line-search paper's Thm 2 / Thm 3 without it (see docs/mechanisms.md).

:func:`zcdp_rho` gives the zCDP parameter of an event (for the zCDP filter): a sub-sampled Gaussian is
charged as unsampled (sampling only adds privacy we do not claim); events that are not ρ-zCDP for a
finite ρ (e.g. the safe SVT bounds) return ``None``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .events import Gaussian, PoissonGaussian, PrivacyEvent

__all__ = [
    "ZCDP",
    "GaussianSVT",
    "LaplaceMechanism",
    "LaplaceSVT",
    "NoisyMin",
    "PureDP",
    "ZCDPConversion",
    "epsilon_from_rho",
    "gaussian_std_for_rho",
    "laplace_rdp",
    "pure_dp_rdp",
    "rho_from_epsilon",
    "zcdp_rho",
]


# ---------------------------------------------------------------------------------------------
# conversions
# ---------------------------------------------------------------------------------------------
def _check_positive(name: str, value: object, allow_zero: bool = False) -> float:
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a real number, got {value!r}") from None
    if math.isnan(x) or math.isinf(x) or x < 0 or (x == 0 and not allow_zero):
        raise ValueError(f"{name} must be a finite number {'>=' if allow_zero else '>'} 0, got {value!r}")
    return x


def _check_delta(delta: object) -> float:
    d = _check_positive("delta", delta)
    if not d < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    return d


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


def _orders(orders: tuple[float, ...]) -> np.ndarray:
    return np.asarray(orders, dtype=np.float64)


def _randomized_response_rdp(a: np.ndarray, eps: float) -> np.ndarray:
    """RDP of ε-randomised response, an upper bound for every ε-DP mechanism.

    ln[(sinh(αε) − sinh((α−1)ε)) / sinh(ε)] / (α−1) simplifies to
    ε + [ln(1 + e^{−(2α−1)ε}) − ln(1 + e^{−ε})] / (α−1), which has no cancellation.
    """
    out = eps + (np.log1p(np.exp(-(2.0 * a - 1.0) * eps)) - math.log1p(math.exp(-eps))) / (a - 1.0)
    return np.maximum(out, 0.0)


def pure_dp_rdp(orders: tuple[float, ...], epsilon: float) -> np.ndarray:
    """Valid RDP curve of any ε-DP mechanism: min(ε, α·ε²/2, RR(α, ε))."""
    a = _orders(orders)
    if epsilon == 0:
        return np.zeros(len(a))
    if math.isinf(epsilon):
        return np.full(len(a), math.inf)
    return np.minimum(np.minimum(epsilon, a * epsilon**2 / 2.0), _randomized_response_rdp(a, epsilon))


def laplace_rdp(orders: tuple[float, ...], e: float) -> np.ndarray:
    """RDP of the Laplace mechanism whose shift/scale ratio is ``e`` (Mironov 2017, Prop. 6); ≤ e."""
    a = _orders(orders)
    if e == 0:
        return np.zeros(len(a))
    if math.isinf(e):
        return np.full(len(a), math.inf)
    # ln[ α/(2α−1)·e^{(α−1)e} + (α−1)/(2α−1)·e^{−αe} ] / (α−1), in log space
    t1 = np.log(a / (2 * a - 1)) + (a - 1) * e
    t2 = np.log((a - 1) / (2 * a - 1)) - a * e
    out = np.logaddexp(t1, t2) / (a - 1)
    return np.minimum(np.maximum(out, 0.0), e)


# ---------------------------------------------------------------------------------------------
# events
# ---------------------------------------------------------------------------------------------
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


@dataclass(frozen=True)
class PureDP(PrivacyEvent, kind="pure_dp"):
    """Any ε-DP release; RDP min(ε, α·ε²/2, RR(α, ε)) and ε²/2-zCDP (DP-AGD Lemma 3.7)."""

    epsilon: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "epsilon", _check_positive("epsilon", self.epsilon, allow_zero=True))

    def rdp(self, orders: tuple[float, ...]) -> np.ndarray:
        return pure_dp_rdp(orders, self.epsilon)

    def zcdp(self) -> float:
        return self.epsilon**2 / 2.0


@dataclass(frozen=True)
class LaplaceMechanism(PrivacyEvent, kind="laplace"):
    """Laplace noise of scale Δ/ε on a query of L1 sensitivity Δ: exact RDP, ε-DP, ε²/2-zCDP."""

    epsilon: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "epsilon", _check_positive("epsilon", self.epsilon, allow_zero=True))

    def rdp(self, orders: tuple[float, ...]) -> np.ndarray:
        return np.minimum(laplace_rdp(orders, self.epsilon), pure_dp_rdp(orders, self.epsilon))

    def zcdp(self) -> float:
        return self.epsilon**2 / 2.0


NoisyMinNoise = Literal["exponential", "laplace", "gumbel"]


@dataclass(frozen=True)
class NoisyMin(PrivacyEvent, kind="noisy_min"):
    """Report-noisy-min over monotone scores (sensitivity Δ) with noise scale Δ/ε.

    ``"exponential"`` (permute-and-flip) and ``"laplace"`` are ε-DP, hence ε²/2-zCDP; ``"gumbel"`` is
    the exponential mechanism, ε-bounded-range, hence ε²/8-zCDP (Cesar & Rogers 2021).
    """

    epsilon: float
    noise: str = "exponential"

    def __post_init__(self) -> None:
        object.__setattr__(self, "epsilon", _check_positive("epsilon", self.epsilon, allow_zero=True))
        if self.noise not in ("exponential", "laplace", "gumbel"):
            raise ValueError(f"noise must be 'exponential', 'laplace' or 'gumbel', got {self.noise!r}")

    def rdp(self, orders: tuple[float, ...]) -> np.ndarray:
        curve = pure_dp_rdp(orders, self.epsilon)
        if self.noise == "gumbel":
            curve = np.minimum(curve, _orders(orders) * self.epsilon**2 / 8.0)
        return curve

    def zcdp(self) -> float:
        return self.epsilon**2 / (8.0 if self.noise == "gumbel" else 2.0)

    @staticmethod
    def epsilon_for_rho(rho: float, noise: str = "exponential") -> float:
        """The ε whose NoisyMin costs exactly ``rho`` zCDP: √(2ρ), or √(8ρ) for Gumbel noise."""
        return math.sqrt((8.0 if noise == "gumbel" else 2.0) * _check_positive("rho", rho))


SVTAccounting = Literal["safe", "paper"]


def _check_svt(accounting: str, max_queries: int) -> None:
    if accounting not in ("safe", "paper"):
        raise ValueError(f"accounting must be 'safe' or 'paper', got {accounting!r}")
    if isinstance(max_queries, bool) or not isinstance(max_queries, int) or max_queries < 1:
        raise ValueError(f"max_queries must be an integer >= 1, got {max_queries!r}")


@dataclass(frozen=True)
class LaplaceSVT(PrivacyEvent, kind="svt_laplace"):
    """AboveThreshold (cut-off 1) with Laplace noise, ε_BT-DP overall (threshold ε/2, queries ε/4).

    ``"paper"``: 2·L(α, ε/2) (line-search paper Thm 2, whose proof has a gap). ``"safe"``: the minimum
    of ε, ε/2 + L(α, ε/2), ln(k)/(α−1) + 2·L(α, ε/2) (Zhu & Wang 2020), α·ε²/2 and RR(α, ε), with
    k = max_queries + 1 (the "fail" outcome counted).
    """

    epsilon: float
    max_queries: int
    accounting: str = "safe"

    def __post_init__(self) -> None:
        object.__setattr__(self, "epsilon", _check_positive("epsilon", self.epsilon, allow_zero=True))
        _check_svt(self.accounting, self.max_queries)

    def rdp(self, orders: tuple[float, ...]) -> np.ndarray:
        a = _orders(orders)
        half = laplace_rdp(orders, self.epsilon / 2.0)
        if self.accounting == "paper":
            return 2.0 * half
        k = self.max_queries + 1
        bounds = [
            pure_dp_rdp(orders, self.epsilon),
            self.epsilon / 2.0 + half,
            math.log(k) / (a - 1.0) + 2.0 * half,
        ]
        return np.minimum.reduce(bounds)


@dataclass(frozen=True)
class GaussianSVT(PrivacyEvent, kind="svt_gaussian"):
    """AboveThreshold with Gaussian noise calibrated to ρ_BT (σ1² = 3/(2ρ), σ2² = 3/ρ, in units of Δ).

    ``"paper"``: α·ρ (line-search paper Thm 3). ``"safe"``: ln(k)/(α−1) + (4/3)·α·ρ (Zhu & Wang 2020,
    Thm 8), k = max_queries + 1.
    """

    rho: float
    max_queries: int
    accounting: str = "safe"

    def __post_init__(self) -> None:
        object.__setattr__(self, "rho", _check_positive("rho", self.rho, allow_zero=True))
        _check_svt(self.accounting, self.max_queries)

    def rdp(self, orders: tuple[float, ...]) -> np.ndarray:
        a = _orders(orders)
        if self.accounting == "paper":
            return a * self.rho
        if self.rho == 0:
            return np.zeros(len(a))
        return math.log(self.max_queries + 1) / (a - 1.0) + (4.0 / 3.0) * a * self.rho

    def zcdp(self) -> float | None:
        return self.rho if self.accounting == "paper" else None


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
