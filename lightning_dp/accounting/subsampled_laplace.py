"""Pure ε-DP Laplace releases on a fixed-size subsample (Kuru et al. 2020, eq. 11), priced by basic composition.

One step adds Laplace noise of scale ``noise_multiplier × S`` to a sum whose replace-one L1 sensitivity is
S, on a uniformly random subset of m of the n examples drawn without replacement. Before sampling that
is (1/noise_multiplier)-DP; amplification by sampling without replacement (Balle, Barthe and Gaboardi
2018, Thm 9) gives ε = ln(1 + (m/n)(e^{1/σ} − 1)). Replace-one neighbours differ from the add/remove
neighbours of the Poisson/Gaussian events, so these events are priced only by ``accountant="pure"``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .events import PrivacyEvent, _check_noise_multiplier, _check_sample_rate

__all__ = ["SubsampledLaplace", "laplace_multiplier", "subsampled_laplace_epsilon"]


def subsampled_laplace_epsilon(noise_multiplier: float, sample_rate: float) -> float:
    """ε = ln(1 + q(e^{1/σ} − 1)) of one step (σ = 0: no noise, ε = ∞), computed without overflow."""
    if noise_multiplier == 0.0:
        return math.inf
    x = 1.0 / noise_multiplier
    if sample_rate >= 1.0:
        return x
    if sample_rate == 0.0:
        return 0.0
    return float(np.logaddexp(math.log1p(-sample_rate), math.log(sample_rate) + x))


def laplace_multiplier(epsilon: float, sample_rate: float) -> float:
    """The σ whose step costs exactly ``epsilon``: 1/σ = ln(1 + (e^ε − 1)/q), the inverse of eq. 11."""
    if not epsilon > 0:
        raise ValueError(f"a step's ε must be > 0, got {epsilon}")
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
    return 1.0 / math.log1p(math.expm1(epsilon) / sample_rate)


@dataclass(frozen=True)
class SubsampledLaplace(PrivacyEvent, kind="pure_laplace"):
    """Laplace noise of scale σ·S (S = replace-one L1 sensitivity) on a fixed-size subsample of rate q = m/n."""

    noise_multiplier: float
    sample_rate: float

    def __post_init__(self) -> None:
        """Validate and normalise to floats (so equal events hash equal)."""
        object.__setattr__(self, "noise_multiplier", _check_noise_multiplier(self.noise_multiplier))
        object.__setattr__(self, "sample_rate", _check_sample_rate(self.sample_rate))

    def pure_epsilon(self) -> float | None:
        """Amplified pure ε of one step (eq. 11)."""
        return subsampled_laplace_epsilon(self.noise_multiplier, self.sample_rate)

    def rdp(self, orders: tuple[float, ...]) -> np.ndarray:
        """Refused: replace-one pure-DP steps do not compose with add/remove RDP events in one ledger."""
        raise ValueError(
            "pure_laplace events (replace-one neighbours, fixed-size sampling) are priced by basic composition: "
            "use accountant='pure'; they cannot be mixed with add/remove RDP events"
        )
