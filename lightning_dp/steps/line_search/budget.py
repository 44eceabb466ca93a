"""The line search's budgets: the filter's order grid, its admission rule and the planner (§3.9)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

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
