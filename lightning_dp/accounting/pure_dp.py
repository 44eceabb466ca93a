"""Pure ε-DP releases priced by RDP: any ε-DP mechanism is bounded by ε-randomised response.

``PureDP(epsilon)``: ε(α) = min(ε, α·ε²/2, RR(α, ε)), RR the RDP of randomised response, the worst ε-DP
mechanism (Mironov 2017, Prop. 5 + Bun & Steinke Prop. 1.4); :func:`pure_dp_rdp` is that curve, which the
Laplace mechanism, NoisyMin and the sparse vector technique take as one of their bounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .arguments import _check_positive, _orders
from .events import PrivacyEvent

__all__ = ["PureDP", "pure_dp_rdp"]


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
