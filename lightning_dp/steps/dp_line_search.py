"""DP stochastic backtracking line search (DP-BLSGD; Chen & Lee 2022) in the step slot.

The step asks the data, privately, how far to move along the released noisy gradient ``d``: Armijo
backtracking over ``η0, βη0, …, β^(max_it−1)η0`` where every sufficient-decrease test is a threshold
query answered by the sparse vector technique (AboveThreshold), so one whole search costs about one
query's budget. Adaptive mode (convex models) adds CHEB: when a search fails, a second noisy gradient
on a fresh batch is compared by angle with the first, and either the gradient budget ρ_grad or the
search budget ε_BT grows by (1+ξ); DP-BLSGD-AC also shrinks both clip thresholds. NN mode (Sec. 5.7)
has a fixed per-iteration budget and falls back to the smallest step instead of failing.

Accounting (see docs/mechanisms.md): by default every data access reads its own Poisson batch and is
amplified separately, SVT is priced with the bounds that are proven (Zhu & Wang 2020 terms, pure-DP
conversions) and every amplification takes the minimum of valid bounds. ``accounting="paper"``
reproduces the paper literally: Thms 2/3 for SVT, Lemma 4 (general) amplification without the minimum,
one batch shared by the gradient and its searches, and the ln(1/δ) multi-order stopping rule.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from opacus.accountants.analysis.rdp import compute_rdp
from scipy.special import gammaln, logsumexp
from torch import Tensor

from lightning_dp.accounting import PrivacyEvent

Accounting = Literal["safe", "paper"]
SVTNoise = Literal["laplace", "gaussian"]

# ----------------------------------------------------------------------------------------------------
# RDP curves (vectorised over orders α); every function returns ε(α) for ONE release.
# ----------------------------------------------------------------------------------------------------


def _orders(orders: Sequence[float] | np.ndarray) -> np.ndarray:
    return np.asarray(orders, dtype=np.float64)


def laplace_rdp(orders: Sequence[float] | np.ndarray, e: float) -> np.ndarray:
    """RDP of a Laplace mechanism whose shift ÷ scale is ``e`` (Mironov 2017), L(α, e) in the spec."""
    a = _orders(orders)
    if e == 0:
        return np.zeros_like(a)
    if math.isinf(e):
        return np.full_like(a, math.inf)
    log_terms = np.logaddexp(np.log(a / (2 * a - 1)) + (a - 1) * e, np.log((a - 1) / (2 * a - 1)) - a * e)
    return log_terms / (a - 1)


def _log_cosh(x: np.ndarray) -> np.ndarray:
    x = np.abs(x)
    return x + np.log1p(np.exp(-2 * x)) - math.log(2.0)


def pure_dp_rr(orders: Sequence[float] | np.ndarray, eps: float) -> np.ndarray:
    """Tight RDP of an ε-DP mechanism (randomised-response worst case).

    RR(α, ε) = ln[(sinh(αε) − sinh((α−1)ε)) / sinh ε]/(α−1) = ln[cosh((2α−1)ε/2) / cosh(ε/2)]/(α−1),
    the second form being overflow-free.
    """
    a = _orders(orders)
    if eps == 0:
        return np.zeros_like(a)
    return (_log_cosh((2 * a - 1) * eps / 2) - float(_log_cosh(np.asarray(eps / 2)))) / (a - 1)


def pure_dp_rdp(orders: Sequence[float] | np.ndarray, eps: float) -> np.ndarray:
    """Best of three valid RDP bounds for an ε-DP release: ε, αε²/2 (Bun–Steinke) and RR(α, ε)."""
    a = _orders(orders)
    return np.minimum(np.minimum(np.full_like(a, eps), a * eps**2 / 2), pure_dp_rr(a, eps))


def pure_dp_amplified(eps: float, q: float) -> float:
    """ε' of an ε-DP mechanism run on a Poisson subsample with rate q: ln(1 + q(e^ε − 1))."""
    return float(math.log1p(q * math.expm1(eps)))


def svt_laplace_rdp(
    orders: Sequence[float] | np.ndarray, eps_bt: float, k: int, accounting: Accounting = "safe"
) -> np.ndarray:
    """RDP of one Laplace NOISYBTLS call (threshold scale 2Δ/ε_BT, query scale 4Δ/ε_BT) on its batch.

    ``"paper"``: Thm 2, 2·L(α, ε_BT/2), whose proof has a gap (A6). ``"safe"``: the minimum of the
    pure-DP bounds (ε_BT-DP by Thm 1), ε_BT/2 + L(α, ε_BT/2), and Zhu & Wang's ln k/(α−1) + 2·L(α, ε_BT/2)
    with k = max_it + 1 outcomes.
    """
    a = _orders(orders)
    half = laplace_rdp(a, eps_bt / 2)
    if accounting == "paper":
        return 2 * half
    return np.minimum.reduce([pure_dp_rdp(a, eps_bt), eps_bt / 2 + half, math.log(k) / (a - 1) + 2 * half])


def svt_gaussian_rdp(
    orders: Sequence[float] | np.ndarray, rho_bt: float, k: int, accounting: Accounting = "safe"
) -> np.ndarray:
    """RDP of one Gaussian NOISYBTLS call (σ1² = 3/(2ρ_BT), σ2² = 3/ρ_BT, in units of Δ_q).

    ``"paper"``: Thm 3, α·ρ_BT. ``"safe"``: Zhu & Wang 2020 Thm 8, ln k/(α−1) + α/σ1² + 2α/σ2²
    = ln k/(α−1) + (4/3)·α·ρ_BT.
    """
    a = _orders(orders)
    if accounting == "paper":
        return a * rho_bt
    return math.log(k) / (a - 1) + (4.0 / 3.0) * a * rho_bt


def amplify_general(
    orders: Sequence[float] | np.ndarray, base: Callable[[np.ndarray], np.ndarray], q: float
) -> np.ndarray:
    """Zhu & Wang 2019 (the paper's Lemma 4): RDP of a mechanism with RDP ``base`` on a Poisson subsample.

    Valid for integer orders α ≥ 2; other orders get ``inf`` (callers take a minimum with other bounds).
    Computed in log space with lgamma binomials.
    """
    a = _orders(orders)
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
        out[i] = float(logsumexp(np.concatenate(([first], terms)))) / (alpha - 1)
    return out


def gaussian_rdp_sgm(orders: Sequence[float] | np.ndarray, rho: float, q: float) -> np.ndarray:
    """Exact RDP of the Poisson-subsampled Gaussian with zCDP ρ = 1/(2z²) (Mironov et al. 2019, Opacus)."""
    a = _orders(orders)
    if rho == 0 or q == 0:
        return np.zeros_like(a)
    if math.isinf(rho):
        return np.full_like(a, math.inf)
    z = 1.0 / math.sqrt(2.0 * rho)
    return np.asarray(compute_rdp(q=q, noise_multiplier=z, steps=1, orders=list(a)), dtype=np.float64)


# ----------------------------------------------------------------------------------------------------
# Ledger events
# ----------------------------------------------------------------------------------------------------


def _check_positive(name: str, value: float) -> float:
    value = float(value)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return value


def _check_rate(value: float) -> float:
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"sample_rate must be in [0, 1], got {value!r}")
    return value


def _check_accounting(value: str) -> str:
    if value not in ("safe", "paper"):
        raise ValueError(f"accounting must be 'safe' or 'paper', got {value!r}")
    return value


@dataclass(frozen=True)
class LineSearchGradient(PrivacyEvent, kind="line_search_gradient"):
    """One noisy gradient of DP-BLSGD: Gaussian with zCDP ρ_grad on a Poisson batch of rate q.

    ``"safe"``: min(α·ρ, exact sampled Gaussian) (the sampled-Gaussian bound is never above Lemma 4).
    ``"paper"``: Lemma 4 on α·ρ, as the paper charges it (at fractional orders: α·ρ).
    """

    rho: float
    sample_rate: float
    accounting: str = "safe"

    def __post_init__(self) -> None:
        object.__setattr__(self, "rho", _check_positive("rho", self.rho))
        object.__setattr__(self, "sample_rate", _check_rate(self.sample_rate))
        object.__setattr__(self, "accounting", _check_accounting(self.accounting))

    def rdp(self, orders: tuple[float, ...]) -> np.ndarray:
        a = _orders(orders)
        unamplified = a * self.rho
        if self.accounting == "paper":
            general = amplify_general(a, lambda x: x * self.rho, self.sample_rate)
            return np.where(np.isfinite(general), general, unamplified)
        return np.minimum(unamplified, gaussian_rdp_sgm(a, self.rho, self.sample_rate))


@dataclass(frozen=True)
class LineSearchSVT(PrivacyEvent, kind="line_search_svt"):
    """One NOISYBTLS call (AboveThreshold over ≤ max_it Armijo queries) on a Poisson batch of rate q.

    ``budget`` is ε_BT (Laplace, pure DP) or ρ_BT (Gaussian); ``k = max_it + 1`` outcomes.
    ``"safe"``: min(unamplified safe bound, Lemma 4 on it, pure-DP amplification for Laplace).
    ``"paper"``: Lemma 4 on the paper's Thm 2/3 bound, without the minimum.
    """

    noise: str
    budget: float
    sample_rate: float
    k: int
    accounting: str = "safe"

    def __post_init__(self) -> None:
        if self.noise not in ("laplace", "gaussian"):
            raise ValueError(f"noise must be 'laplace' or 'gaussian', got {self.noise!r}")
        object.__setattr__(self, "budget", _check_positive("budget", self.budget))
        object.__setattr__(self, "sample_rate", _check_rate(self.sample_rate))
        if int(self.k) < 1:
            raise ValueError(f"k must be ≥ 1, got {self.k!r}")
        object.__setattr__(self, "k", int(self.k))
        object.__setattr__(self, "accounting", _check_accounting(self.accounting))

    def base(self, orders: np.ndarray) -> np.ndarray:
        """Unamplified RDP on the batch."""
        if self.noise == "laplace":
            return svt_laplace_rdp(orders, self.budget, self.k, self.accounting)  # type: ignore[arg-type]
        return svt_gaussian_rdp(orders, self.budget, self.k, self.accounting)  # type: ignore[arg-type]

    def rdp(self, orders: tuple[float, ...]) -> np.ndarray:
        a = _orders(orders)
        unamplified = self.base(a)
        general = amplify_general(a, self.base, self.sample_rate)
        if self.accounting == "paper":
            return np.where(np.isfinite(general), general, unamplified)
        best = np.minimum(unamplified, general)
        if self.noise == "laplace":
            best = np.minimum(best, pure_dp_rdp(a, pure_dp_amplified(self.budget, self.sample_rate)))
        return best


@dataclass(frozen=True)
class LineSearchJoint(PrivacyEvent, kind="line_search_joint"):
    """A noisy gradient and one NOISYBTLS call on the SAME Poisson batch, amplified jointly (mode J).

    Valid because the per-iteration structure is fixed (NN mode). ``"safe"``: min(Σ base, Lemma 4 on
    Σ base) with the safe SVT bound; ``"paper"``: Lemma 4 on α·ρ_grad + Thm 2/3, no minimum.
    """

    rho_grad: float
    noise: str
    budget: float
    sample_rate: float
    k: int
    accounting: str = "safe"

    def __post_init__(self) -> None:
        object.__setattr__(self, "rho_grad", _check_positive("rho_grad", self.rho_grad))
        svt = LineSearchSVT(self.noise, self.budget, self.sample_rate, self.k, self.accounting)
        object.__setattr__(self, "budget", svt.budget)
        object.__setattr__(self, "sample_rate", svt.sample_rate)
        object.__setattr__(self, "k", svt.k)

    def base(self, orders: np.ndarray) -> np.ndarray:
        svt = LineSearchSVT(self.noise, self.budget, 1.0, self.k, self.accounting)
        return orders * self.rho_grad + svt.base(orders)

    def rdp(self, orders: tuple[float, ...]) -> np.ndarray:
        a = _orders(orders)
        unamplified = self.base(a)
        general = amplify_general(a, self.base, self.sample_rate)
        if self.accounting == "paper":
            return np.where(np.isfinite(general), general, unamplified)
        return np.minimum(unamplified, general)


def rdp_to_dp_prop1(rdp: np.ndarray, orders: Sequence[float], delta: float) -> float:
    """The paper's Prop. 1 conversion, min_α rdp(α) + ln(1/δ)/(α−1) (looser than the ledger's)."""
    a = _orders(orders)
    return float(np.min(np.asarray(rdp) + math.log(1 / delta) / (a - 1)))


# ----------------------------------------------------------------------------------------------------
# NOISYBTLS (Alg. 1): the sparse-vector backtracking search
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SVTCalibration:
    """Noise of one search: threshold noise drawn once, fresh query noise per trial (scale or std)."""

    noise: str
    threshold_scale: float
    query_scale: float


def svt_calibration(noise: SVTNoise, budget: float, sensitivity: float) -> SVTCalibration:
    """Laplace: scales 2Δ/ε_BT and 4Δ/ε_BT. Gaussian: stds Δ·√(3/(2ρ_BT)) and Δ·√(3/ρ_BT).

    ``budget = inf`` gives a noise-free search (exact Armijo), used by tests.
    """
    if math.isinf(budget):
        return SVTCalibration(noise, 0.0, 0.0)
    if noise == "laplace":
        return SVTCalibration(noise, 2 * sensitivity / budget, 4 * sensitivity / budget)
    if noise == "gaussian":
        return SVTCalibration(
            noise, sensitivity * math.sqrt(3 / (2 * budget)), sensitivity * math.sqrt(3 / budget)
        )
    raise ValueError(f"noise must be 'laplace' or 'gaussian', got {noise!r}")


def draw_noise(noise: str, scale: float, generator: torch.Generator) -> float:
    """One Laplace (scale b, as a difference of two exponentials) or Gaussian (std) draw in float64.

    Not hardened against floating-point attacks (Mironov 2012); see docs/mechanisms.md.
    """
    if scale == 0:
        return 0.0
    if noise == "laplace":
        u = torch.rand(2, generator=generator, dtype=torch.float64)
        e = -torch.log1p(-u)  # rand is in [0, 1): both exponentials are finite
        return float(scale * (e[0] - e[1]))
    return float(scale * torch.randn(1, generator=generator, dtype=torch.float64)[0])


@dataclass(frozen=True)
class SearchResult:
    """What one search releases (``eta``, ``index``) and what it cost in forwards (``evaluations``)."""

    eta: float
    index: int
    """1-based index of the accepted candidate, 0 when the search failed."""
    evaluations: int


def candidate_steps(eta0: float, beta: float, max_it: int) -> list[float]:
    """η0, βη0, …, β^(max_it−1)·η0."""
    return [eta0 * beta**i for i in range(max_it)]


def noisy_backtracking(
    f0: float,
    loss_at: Callable[[int, float], float],
    d_sq_norm: float,
    *,
    eta0: float,
    beta: float,
    max_it: int,
    c: float,
    calibration: SVTCalibration,
    generator: torch.Generator,
    on_fail: Literal["zero", "smallest"] = "zero",
) -> SearchResult:
    """NOISYBTLS: accept the first η with F0 − cη‖d‖² − F(w − ηd) + ν_i ≥ λ (threshold 0 + noise).

    ``loss_at(i, η)`` returns the (mean-scale, clipped) objective at the i-th candidate (0-based); it is
    called lazily, so an accepted early candidate saves forwards. Nothing but η/index leaves here.
    """
    threshold = draw_noise(calibration.noise, calibration.threshold_scale, generator)
    for i, eta in enumerate(candidate_steps(eta0, beta, max_it)):
        query = f0 - c * eta * d_sq_norm - loss_at(i, eta)
        if query + draw_noise(calibration.noise, calibration.query_scale, generator) >= threshold:
            return SearchResult(eta, i + 1, i + 1)
    fallback = eta0 * beta**max_it if on_fail == "smallest" else 0.0
    return SearchResult(fallback, 0, max_it)


# ----------------------------------------------------------------------------------------------------
# CHEB (Alg. 3), angle EMA, η0 reset, clip adaptation: post-processing of released values only
# ----------------------------------------------------------------------------------------------------


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


def clip_objective(losses: Tensor, c_obj: float) -> Tensor:
    """Per-example losses clamped to [0, C_obj], so one example moves F_B by at most C_obj (sum scale)."""
    return losses.clamp(min=0.0, max=c_obj)
