"""NOISYBTLS (Chen & Lee 2022, Alg. 1): the sparse-vector backtracking search and its noise.

Only the accepted step size and its index leave a search; the queries stay inside.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

SVTNoise = Literal["laplace", "gaussian"]


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


def search_direction(
    data: list[Tensor], params: list[nn.Parameter], mu: float
) -> tuple[list[Tensor], float, Callable[[float], float]]:
    """d = data + μw (``mu``: the weight decay μ), ‖d‖² and the regulariser's value at w − η·d (0 without
    weight decay): what the search moves along and adds to the loss it queries."""
    with torch.no_grad():
        direction = [g + mu * p.detach().to(g.dtype) for g, p in zip(data, params, strict=True)]
        d_sq = math.fsum(float((x.double() ** 2).sum()) for x in direction)
        w_sq = math.fsum(float((p.detach().double() ** 2).sum()) for p in params)
        w_d = math.fsum(
            float((p.detach().double() * x.double()).sum()) for p, x in zip(params, direction, strict=True)
        )

    def reg(eta: float) -> float:
        return 0.5 * mu * (w_sq - 2 * eta * w_d + eta * eta * d_sq) if mu else 0.0

    return direction, d_sq, reg
