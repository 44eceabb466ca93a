"""The line search's budgets: the filter's order grid, its admission rule, the planner (§3.9) and what one
iteration costs at a per-iteration budget (:func:`iteration_cost`, :func:`split_budget`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from lightning_dp.accounting.line_search_events import LineSearchGradient, LineSearchJoint, LineSearchSVT
from lightning_dp.accounting.rdp import event_rdp
from lightning_dp.steps.line_search.config import LineSearchConfig

#: A small geometric grid of integer orders in [2, 1024]: the strict filter pays ln(|Λ|/δ), and small ε
#: needs large orders (ε = 0.05 at δ = 1e-8 needs α ≥ 370).
LINE_SEARCH_ORDERS: tuple[float, ...] = tuple(
    float(a) for a in sorted({round(2 * 512 ** (i / 31)) for i in range(32)})
)


def fits_budget(cost: np.ndarray, budgets: np.ndarray, spent: np.ndarray | None = None) -> bool:
    """The filter rule: some order α with a positive budget still has spent(α) + cost(α) ≤ B(α)."""
    total = cost if spent is None else spent + cost
    return bool(np.any((budgets > 0) & (total <= budgets)))


def plan_budget(
    iteration_cost: Callable[[float], np.ndarray],
    budgets: np.ndarray,
    iterations: int,
    lo: float = 1e-12,
    hi: float = 100.0,
) -> float:
    """Largest x (by bisection in log space) such that ``iterations`` × ``iteration_cost(x)`` fits ``budgets``.

    The budget planner of §3.9: x is ε_iter (adaptive mode) or ρ_iter (NN mode). Raises ValueError when
    even ``lo`` does not fit.
    """
    if not fits_budget(iterations * iteration_cost(lo), budgets):
        raise ValueError(f"not even {iterations} iterations at a per-iteration budget of {lo:g} fit")
    if fits_budget(iterations * iteration_cost(hi), budgets):
        return hi
    a, b = math.log(lo), math.log(hi)
    for _ in range(80):
        mid = (a + b) / 2
        if fits_budget(iterations * iteration_cost(math.exp(mid)), budgets):
            a = mid
        else:
            b = mid
    return math.exp(a)


def split_budget(config: LineSearchConfig, rho: float) -> tuple[float, float]:
    """(ρ_grad, the search budget) of ρ. NN mode: ρ is the per-iteration budget ρ_iter, split by
    ``grad_fraction``; adaptive: ρ is ρ_grad (ε_iter = √(2ρ), A22). The search budget is ε_BT under Laplace
    noise, ρ_BT under Gaussian."""
    if config.mode == "nn":
        rho_grad = config.grad_fraction * rho
        rho_bt = (1 - config.grad_fraction) * rho
        return rho_grad, (math.sqrt(2 * rho_bt) if config.noise == "laplace" else rho_bt)
    eps_iter = math.sqrt(2 * rho)
    return rho, (eps_iter if config.noise == "laplace" else eps_iter**2 / 2)


def iteration_cost(
    config: LineSearchConfig, sample_rate: float, orders: Sequence[float]
) -> Callable[[float], np.ndarray]:
    """The RDP at ``orders`` of one iteration (its gradient and its search) as a function of the per-iteration
    budget :func:`plan_budget` sizes: ε_iter in adaptive mode, ρ_iter in NN mode (one joint event when the
    search reads the gradient's batch, ``line_search_batch="same"``)."""
    k = config.max_it
    if config.mode == "adaptive":

        def adaptive_cost(eps_iter: float) -> np.ndarray:
            budget = eps_iter if config.noise == "laplace" else eps_iter**2 / 2
            grad = LineSearchGradient(eps_iter**2 / 2, sample_rate, config.accounting)
            svt = LineSearchSVT(config.noise, budget, sample_rate, k, config.accounting)
            return event_rdp(grad, orders) + event_rdp(svt, orders)

        return adaptive_cost
    joint = config.line_search_batch == "same"

    def nn_cost(rho_iter: float) -> np.ndarray:
        rho_grad = config.grad_fraction * rho_iter
        rho_bt = (1 - config.grad_fraction) * rho_iter
        budget = math.sqrt(2 * rho_bt) if config.noise == "laplace" else rho_bt
        if joint:
            return event_rdp(
                LineSearchJoint(rho_grad, config.noise, budget, sample_rate, k, config.accounting), orders
            )
        grad = LineSearchGradient(rho_grad, sample_rate, config.accounting)
        svt = LineSearchSVT(config.noise, budget, sample_rate, k, config.accounting)
        return event_rdp(grad, orders) + event_rdp(svt, orders)

    return nn_cost
