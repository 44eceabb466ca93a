"""Ledger events of DP-BLSGD (Chen & Lee 2022): its noisy gradient, its sparse-vector search, and both
on one batch, each on a Poisson subsample and amplified (see docs/mechanisms.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from lightning_dp.accounting.amplification import (
    amplify_general,
    gaussian_rdp_sgm,
    orders_array,
    pure_dp_amplified,
)
from lightning_dp.accounting.events import PrivacyEvent
from lightning_dp.accounting.pure_dp import pure_dp_rdp
from lightning_dp.accounting.svt import GaussianSVT, LaplaceSVT


def svt_base(noise: str, budget: float, max_queries: int, accounting: str) -> PrivacyEvent:
    """The unamplified SVT event of one search (the accounting package's LaplaceSVT / GaussianSVT)."""
    if noise == "laplace":
        return LaplaceSVT(budget, max_queries, accounting)
    return GaussianSVT(budget, max_queries, accounting)


def _lemma4(
    orders: np.ndarray, base: Callable[[np.ndarray], np.ndarray], sample_rate: float, paper: bool
) -> np.ndarray:
    """Lemma 4 (general amplification) on the unamplified curve ``base``: ``paper``, the bound where it is
    finite (the unamplified curve elsewhere), as the paper charges it; else its minimum with the unamplified."""
    unamplified = base(orders)
    general = amplify_general(orders, base, sample_rate)
    if paper:
        return np.where(np.isfinite(general), general, unamplified)
    return np.minimum(unamplified, general)


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
        a = orders_array(orders)
        if self.accounting == "paper":
            return _lemma4(a, lambda x: x * self.rho, self.sample_rate, paper=True)
        return np.minimum(a * self.rho, gaussian_rdp_sgm(a, self.rho, self.sample_rate))


@dataclass(frozen=True)
class LineSearchSVT(PrivacyEvent, kind="line_search_svt"):
    """One NOISYBTLS call (AboveThreshold over ≤ max_queries Armijo tests) on a Poisson batch of rate q.

    ``budget`` is ε_BT (Laplace, pure DP) or ρ_BT (Gaussian); the unamplified curve is LaplaceSVT /
    GaussianSVT. ``"safe"``: min(unamplified safe bound, Lemma 4 on it, pure-DP amplification for
    Laplace). ``"paper"``: Lemma 4 on the paper's Thm 2/3 bound, without the minimum.
    """

    noise: str
    budget: float
    sample_rate: float
    max_queries: int
    accounting: str = "safe"

    def __post_init__(self) -> None:
        if self.noise not in ("laplace", "gaussian"):
            raise ValueError(f"noise must be 'laplace' or 'gaussian', got {self.noise!r}")
        object.__setattr__(self, "budget", _check_positive("budget", self.budget))
        object.__setattr__(self, "sample_rate", _check_rate(self.sample_rate))
        object.__setattr__(self, "accounting", _check_accounting(self.accounting))
        svt_base(self.noise, self.budget, self.max_queries, self.accounting)  # validates max_queries

    def base(self, orders: np.ndarray) -> np.ndarray:
        """Unamplified RDP on the batch."""
        event = svt_base(self.noise, self.budget, self.max_queries, self.accounting)
        return np.asarray(event.rdp(tuple(float(a) for a in orders)), dtype=np.float64)

    def rdp(self, orders: tuple[float, ...]) -> np.ndarray:
        paper = self.accounting == "paper"
        best = _lemma4(orders_array(orders), self.base, self.sample_rate, paper)
        if not paper and self.noise == "laplace":
            best = np.minimum(best, pure_dp_rdp(orders, pure_dp_amplified(self.budget, self.sample_rate)))
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
    max_queries: int
    accounting: str = "safe"

    def __post_init__(self) -> None:
        object.__setattr__(self, "rho_grad", _check_positive("rho_grad", self.rho_grad))
        svt = LineSearchSVT(self.noise, self.budget, self.sample_rate, self.max_queries, self.accounting)
        object.__setattr__(self, "budget", svt.budget)
        object.__setattr__(self, "sample_rate", svt.sample_rate)

    def base(self, orders: np.ndarray) -> np.ndarray:
        svt = svt_base(self.noise, self.budget, self.max_queries, self.accounting)
        return orders * self.rho_grad + np.asarray(svt.rdp(tuple(float(a) for a in orders)))

    def rdp(self, orders: tuple[float, ...]) -> np.ndarray:
        return _lemma4(orders_array(orders), self.base, self.sample_rate, self.accounting == "paper")
