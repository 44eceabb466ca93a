"""The sparse vector technique priced by RDP: one AboveThreshold run (cut-off 1) over at most ``max_queries``
queries.

``LaplaceSVT`` / ``GaussianSVT``: ``accounting="safe"`` (default) adds the ln(k)/(α−1) term of Zhu & Wang
2020, ``"paper"`` is the line-search paper's Thm 2 / Thm 3 without it (see docs/mechanisms.md). The run
itself is ``steps/line_search/svt.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .arguments import _check_positive, _orders
from .events import PrivacyEvent
from .laplace_mechanism import laplace_rdp
from .pure_dp import pure_dp_rdp

__all__ = ["GaussianSVT", "LaplaceSVT"]

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
