"""The Laplace mechanism priced by RDP: ``LaplaceMechanism(epsilon)``, Laplace noise of scale Δ/ε on a
query of L1 sensitivity Δ; its exact RDP (Mironov 2017, Prop. 6), ε-DP and ε²/2-zCDP."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .arguments import _check_positive, _orders
from .events import PrivacyEvent
from .pure_dp import pure_dp_rdp

__all__ = ["LaplaceMechanism", "laplace_rdp"]


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
