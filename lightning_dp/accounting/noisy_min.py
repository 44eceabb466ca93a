"""Report-noisy-min priced by RDP: ``NoisyMin(epsilon, noise)`` over monotone scores of sensitivity Δ with
exponential (default) or Laplace noise of scale Δ/ε (ε-DP), or Gumbel noise (the exponential mechanism,
ε-bounded-range, hence ε²/8-zCDP, Cesar & Rogers 2021)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .arguments import _check_positive, _orders
from .events import PrivacyEvent
from .pure_dp import pure_dp_rdp

__all__ = ["NoisyMin"]

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
