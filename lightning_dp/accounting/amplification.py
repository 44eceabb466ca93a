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
    orders: Sequence[float] | np.ndarray,
    base: Callable[[np.ndarray], np.ndarray],
    q: float,
    *,
    symmetric: bool = False,
) -> np.ndarray:
    """Zhu & Wang 2019 (the paper's Lemma 4): RDP of a mechanism with RDP ``base`` on a Poisson subsample.

    Valid for integer orders α ≥ 2; other orders get ``inf`` (callers take a minimum with other bounds).
    Computed in log space with lgamma binomials.

    ``symmetric=True``: the mechanism adds noise whose law is symmetric (Z ~ −Z) to a sum that one unit
    moves by v, on a lattice or space closed under y ↦ v − y (the discrete Gaussian on Z^d, and any sum of
    such shares). Then the terms l ≥ 3 need no factor 3: adding a unit gives E_P[(1 − q + qL)^α] =
    Σ_l C(α,l)(1−q)^{α−l} q^l e^{(l−1)ε(l)} exactly (L = R/P, E_P[L^l] = e^{(l−1)D_l(R‖P)}), and the
    involution y ↦ v − y, which swaps P and R, shows that removing one costs no more
    (:func:`removal_gap`); with ε(l) = l/(2σ²) this is Mironov et al.'s integer-order sampled Gaussian.
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
        if not symmetric:
            terms[1:] += math.log(3.0)  # the terms l ≥ 3 carry a factor 3
        first = (alpha - 1) * log_1q + math.log1p((alpha - 1) * q)
        out[i] = max(0.0, float(logsumexp(np.concatenate(([first], terms)))) / (alpha - 1))  # no rounding < 0
    return out


def removal_gap(likelihood_ratio: np.ndarray, q: float, alpha: float) -> np.ndarray:
    """F(L) = A(u) + L·A(w) ≥ 0, A(t) = t^α − t^{1−α}, u = 1 − q + qL, w = 1 − q + q/L: the symmetrised
    difference of the adding and the removing moments of a Poisson-subsampled pair swapped by an involution
    (E_P[F(L)] = 2·(E_P[(Q/P)^α] − E_P[(Q/P)^{1−α}]), Q = (1 − q)P + qR).

    Why it is never negative (α ≥ 1, 0 ≤ q ≤ 1): F(1/L) = F(L)/L, so take L ≥ 1 and x = q(L − 1). A is concave
    on (0, 1] (A'' = α(α−1)(t^{α−2} − t^{−α−1}) ≤ 0 there), so h(L) = L·A(1 − x/L) has h' = A(s) + (1 − s)A'(s)
    ≥ A(1) = 0 (s = 1 − x/L: a concave function lies below its tangent at s). As L ≥ 1 + x,
    F = A(1 + x) + h(L) ≥ A(1 + x) + (1 + x)·A(1/(1 + x)) = 0. Kept as a function so the tests check it.
    """
    L = np.asarray(likelihood_ratio, dtype=np.float64)
    u, w = 1 - q + q * L, 1 - q + q / L

    def a(t: np.ndarray) -> np.ndarray:
        out: np.ndarray = t**alpha - t ** (1 - alpha)
        return out

    out: np.ndarray = a(u) + L * a(w)
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
