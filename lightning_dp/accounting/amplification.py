"""Privacy amplification by Poisson subsampling, as RDP curves over orders α (one release each).

Used by the line search's events (:mod:`lightning_dp.accounting.line_search_events`): the general
Zhu & Wang bound for any RDP mechanism, the exact sampled Gaussian, pure-DP amplification, and the
paper's Prop. 1 RDP → (ε, δ) conversion for reproduction.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
from opacus.accountants.analysis.rdp import compute_rdp
from scipy.special import gammaln, logsumexp


def orders_array(orders: Sequence[float] | np.ndarray) -> np.ndarray:
    """The orders α as a float64 array."""
    return np.asarray(orders, dtype=np.float64)


def pure_dp_amplified(eps: float, q: float) -> float:
    """ε' of an ε-DP mechanism run on a Poisson subsample with rate q: ln(1 + q(e^ε − 1))."""
    if eps > 1:  # e^ε (q + (1 − q) e^{−ε}): no overflow
        return float(eps + math.log(q + (1 - q) * math.exp(-eps)))
    return float(math.log1p(q * math.expm1(eps)))


def amplify_general(
    orders: Sequence[float] | np.ndarray, base: Callable[[np.ndarray], np.ndarray], q: float
) -> np.ndarray:
    """Zhu & Wang 2019 (the paper's Lemma 4): RDP of a mechanism with RDP ``base`` on a Poisson subsample.

    Valid for integer orders α ≥ 2; other orders get ``inf`` (callers take a minimum with other bounds).
    Computed in log space with lgamma binomials.
    """
    a = orders_array(orders)
    out = np.full_like(a, math.inf)
    if q == 0:
        return np.zeros_like(a)
    ints = [int(x) for x in a if x >= 2 and float(x).is_integer()]
    if not ints:
        return out
    if q >= 1:
        values = base(a)
        return np.where((a >= 2) & (a == np.round(a)), values, math.inf)
    top = max(ints)
    ls = np.arange(2, top + 1, dtype=np.float64)
    eps_l = base(ls)  # ε(l) for l = 2..top
    log_q, log_1q = math.log(q), math.log1p(-q)
    for i, x in enumerate(a):
        if not (x >= 2 and float(x).is_integer()):
            continue
        alpha = int(x)
        js = np.arange(2, alpha + 1, dtype=np.float64)
        log_binom = gammaln(alpha + 1) - gammaln(js + 1) - gammaln(alpha - js + 1)
        terms = log_binom + js * log_q + (alpha - js) * log_1q + (js - 1) * eps_l[: alpha - 1]
        terms[1:] += math.log(3.0)  # the terms l ≥ 3 carry a factor 3
        first = (alpha - 1) * log_1q + math.log1p((alpha - 1) * q)
        out[i] = max(0.0, float(logsumexp(np.concatenate(([first], terms)))) / (alpha - 1))  # no rounding < 0
    return out


def gaussian_rdp_sgm(orders: Sequence[float] | np.ndarray, rho: float, q: float) -> np.ndarray:
    """Exact RDP of the Poisson-subsampled Gaussian with zCDP ρ = 1/(2z²) (Mironov et al. 2019, Opacus)."""
    a = orders_array(orders)
    if rho == 0 or q == 0:
        return np.zeros_like(a)
    if math.isinf(rho):
        return np.full_like(a, math.inf)
    z = 1.0 / math.sqrt(2.0 * rho)
    values = np.asarray(compute_rdp(q=q, noise_multiplier=z, steps=1, orders=list(a)), dtype=np.float64)
    # Opacus's series loses all precision for huge z at large orders (NaN/negative): no bound there.
    return np.where(np.isfinite(values) & (values >= 0), values, math.inf)


def rdp_to_dp_prop1(rdp: np.ndarray, orders: Sequence[float], delta: float) -> float:
    """The paper's Prop. 1 conversion, min_α rdp(α) + ln(1/δ)/(α−1) (looser than the ledger's)."""
    a = orders_array(orders)
    return float(np.min(np.asarray(rdp) + math.log(1 / delta) / (a - 1)))
